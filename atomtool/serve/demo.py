"""The built-in demo model and ``atomtool demo``.

The demo model (``atomtool/demo_model/``) is a ~0.2M-parameter DeepSeek-V3.2-family checkpoint
(``DeepseekV32ForCausalLM``: MLA, a DSA indexer whose ``index_topk`` is smaller than the text, MoE)
trained by ``scripts/train_demo.py`` to recite the Zen of Python (the text of CPython's ``this``
module). See docs/DEMO_MODEL.md.
"""

from __future__ import annotations

import codecs
from pathlib import Path

#: The completion prompt the demo (and the tests) start from; greedy decoding recites the rest.
DEMO_PROMPT = "Beautiful is better than"
#: The user message the chat sample of the training data uses.
DEMO_CHAT_MESSAGE = "Recite the Zen of Python."


def demo_model_path() -> Path:
    """Directory of the shipped demo checkpoint (config.json, model.safetensors, tokenizer files)."""
    return Path(__file__).resolve().parent.parent / "demo_model"


def zen_of_python() -> str:
    """The full Zen of Python (title line included), decoded from ``this.s`` without printing it.

    ``import this`` prints the text the first time it is imported, so the module's rot13 source
    string is read with stdout silenced.
    """
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def zen_body() -> str:
    """The aphorisms only (from ``"Beautiful is better than ugly."`` to the end, no title line)."""
    text = zen_of_python()
    return text[text.index(DEMO_PROMPT):]


def expected_continuation() -> str:
    """What greedy decoding from :data:`DEMO_PROMPT` must produce (the rest of :func:`zen_body`)."""
    return zen_body()[len(DEMO_PROMPT):]
