"""A written per-stage layout: Megatron-core's --pipeline-model-parallel-layout (torch-free).

The string lists the pipeline's virtual stages in model order, separated by "|": "E" the embedding, "t" one
transformer layer, "L" the loss (our final norm and LM head); "(...)*n" and "x*n" repeat, commas are
cosmetic. "Et*3|t*4|t*4|t*3L" cuts a 14-layer model over 4 stages. Megatron numbers the virtual stages
virtual-chunk-major (stage v p + r is chunk v of rank r), which is our model order for interleaved; under the
V placements the order is the model's too, so a layout names each stage's layers whatever the placement.
Megatron's multi-token-prediction layer ("m") does not exist here and is refused.

--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers are layouts too (`first_last_layout`):
the first and last stages hold those many transformer layers, the others an even share of the rest.

In the ds_config: "pipeline": {"partition_method": "layout:Et*3|t*4|t*4|t*3L"}.
"""
from __future__ import annotations

PREFIX = "layout:"
_KINDS = {"E": "the embedding", "t": "a transformer layer", "L": "the loss (final norm and LM head)"}


class LayoutError(ValueError):
    """A layout that cannot cut this model into this schedule's stages (the callers make it a ConfigError)."""


def is_layout(method) -> bool:
    return isinstance(method, str) and method.startswith(PREFIX)


def parse(text: str) -> list[str]:
    """The stages of a layout string, each a string of E/t/L; LayoutError naming what is wrong."""
    where = f"layout {text!r}"
    flat, rest = _unroll(text.replace(",", "").replace(" ", ""), where)
    if rest:
        raise LayoutError(f"{where}: unbalanced ')' at {rest!r}")
    for char in flat:
        if char == "m":
            raise LayoutError(f"{where}: 'm' (Megatron's multi-token-prediction layer) has no layer here")
        if char not in _KINDS and char != "|":
            raise LayoutError(f"{where}: {char!r} is no layer; use E (embedding), t (transformer layer), L (loss), "
                              "| between stages, (...)*n or x*n to repeat")
    return flat.split("|")


def _unroll(text: str, where: str) -> tuple[str, str]:
    """(text up to an unmatched ')' with every repeat unrolled, what follows it)."""
    out = []
    while text:
        head, text = text[0], text[1:]
        if head == ")":
            return "".join(out), ")" + text
        if head == "(":
            inner, text = _unroll(text, where)
            if not text.startswith(")"):
                raise LayoutError(f"{where}: '(' without its ')'")
            text = text[1:]
            piece = inner
        else:
            piece = head
        if text.startswith("*"):
            digits = len(text[1:]) - len(text[1:].lstrip("0123456789"))
            if not digits:
                raise LayoutError(f"{where}: '*' needs a count")
            piece, text = piece * int(text[1:1 + digits]), text[1 + digits:]
        out.append(piece)
    return "".join(out), ""


def layout_bounds(text: str, num_layers: int, stages: int, vocab_parallel: bool = False) -> list[int]:
    """Bounds (len stages + 1) of each virtual stage over the pipeline's layers [embedding, L transformer
    layers, final norm, LM head]: the loss's stage takes the final norm and the head (under vocabulary
    parallelism the head sits beside the stages and leaves the list)."""
    where = f"layout {text!r}"
    cut = parse(text)
    if len(cut) != stages:
        raise LayoutError(f"{where} has {len(cut)} stages; the schedule cuts the model into {stages} virtual stages")
    joined = "".join(cut)
    if joined.count("E") != 1 or not cut[0].startswith("E"):
        raise LayoutError(f"{where}: the embedding (E) comes once, first in the first stage")
    if joined.count("L") != 1 or not cut[-1].endswith("L"):
        raise LayoutError(f"{where}: the loss (L) comes once, last in the last stage")
    if joined.count("t") != num_layers:
        raise LayoutError(f"{where} places {joined.count('t')} transformer layers; the model has {num_layers}")
    for i, stage in enumerate(cut):
        if not stage:
            raise LayoutError(f"{where}: stage {i} holds no layer; every stage needs at least one")
    bounds, at = [0], 0
    for stage in cut:
        at += stage.count("E") + stage.count("t") + ("L" in stage) * (1 if vocab_parallel else 2)  # norm (+ head)
        bounds.append(at)
    return bounds


def first_last_layout(first: int | None, last: int | None, num_layers: int, stages: int) -> str:
    """The layout of --decoder-first/last-pipeline-num-layers: those many transformer layers on the first and
    the last stage (None: an even share), the rest evenly over the stages between."""
    if stages < 2:
        raise LayoutError("--decoder-first/last-pipeline-num-layers need at least two pipeline stages")
    middle = stages - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        given = " and ".join(f"--decoder-{name}-pipeline-num-layers {n}" for name, n in (("first", first),
                                                                                        ("last", last)) if n is not None)
        raise LayoutError(f"{given} leave {rest} of --num-layers {num_layers} to the {middle} other stages: "
                          "they must split evenly")
    share = rest // middle if middle else 0
    counts = [share] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return "|".join(("E" if i == 0 else "") + "t" * n + ("L" if i == stages - 1 else "") for i, n in enumerate(counts))
