"""bench/head_loss.py at toy size on CPU: every form runs and gives eager's loss and gradients (fp32),
and the chunked form keeps less for backward than eager (structure, not timings)."""
from bench import head_loss

TOY = ["--tokens", "64", "--hidden-size", "32", "--vocab-size", "500", "--loss-chunk-size", "16", "--repeats", "1",
       "--warmup", "1"]


def test_every_form_equals_eager(capsys):
    rows = head_loss.main(TOY)
    assert set(rows) == {"eager", "compiled", "chunked", "chunked-compiled"}  # no Liger row without CUDA
    assert not [form for form, row in rows.items() if isinstance(row, str)], rows
    _, (loss, dh, dw, kept), _ = rows["eager"]
    for form in ("compiled", "chunked", "chunked-compiled"):
        ms, (f_loss, f_dh, f_dw, f_kept), _ = rows[form]
        assert ms > 0 and abs(f_loss.item() - loss.item()) < 1e-6, form
        assert (f_dh - dh).abs().max() < 1e-6 and (f_dw - dw).abs().max() < 1e-6, form
    assert rows["chunked"][1][3] < kept and rows["chunked-compiled"][1][3] < kept
    assert "/ eager" in capsys.readouterr().out


def test_loss_only_times_the_loss_on_given_logits(capsys):
    rows = head_loss.main(TOY + ["--loss-only"])
    assert set(rows) == {"eager", "compiled"}
    (_, (loss, dlogits, _, kept), _), (_, (c_loss, c_dlogits, _, c_kept), _) = rows["eager"], rows["compiled"]
    assert abs(c_loss.item() - loss.item()) < 1e-6 and (c_dlogits - dlogits).abs().max() < 1e-6
    assert kept >= 64 * 500 * 4 and c_kept >= 64 * 500 * 4  # fp32: each keeps a logits-sized tensor
    assert "loss of 64 tokens x vocabulary 500" in capsys.readouterr().out
