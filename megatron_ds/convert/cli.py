"""What the checkpoint tools share: the tokenizer override flags, quiet library calls, and the exit-code rule."""
import contextlib
import io
import os
import sys

from . import ToolError


def add_tokenizer_override_args(parser):
    g = parser.add_argument_group("tokenizer (default: the one the run used, from the checkpoint's arguments)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json / encoder.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt / vocab.bpe")
    g.add_argument("--tokenizer-name-or-path", default=None, help="a local Hugging Face tokenizer folder")


@contextlib.contextmanager
def quiet():
    """Drop what the training code prints while building (stdout is the tools' own output)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def run_tool(prog, fn, *args, **kwargs):
    """fn(*args, **kwargs); bad input (ToolError) is one line on stderr and exit code 2.

    The tools' modules import torch, transformers and DeepSpeed inside their functions, after this."""
    import torch
    import transformers
    if not torch.cuda.is_available():  # DeepSpeed would log its CPU fallback: a second line on stderr
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers.logging.set_verbosity_error()  # its warnings and progress bars would bury our one line
    transformers.utils.logging.disable_progress_bar()
    try:
        fn(*args, **kwargs)
    except ToolError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
