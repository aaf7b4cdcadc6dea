"""A broken ``--chat-template`` stops ``atomtool serve`` at startup (one line, exit 1, before the model
loads) instead of serving and answering every chat request with a 400."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import ConfigError
from atomtool.serve.api.chat import compile_chat_template, load_chat_template
from tests.checkpoints import write_hf_checkpoint

BROKEN = "{% for m in messages %}{{ m.content }"  # the tester's template: '}}' typed as '}'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


@pytest.fixture
def no_load(monkeypatch):
    import atomtool.serve.engine.llm_engine as llm_engine

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the chat template was checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "from_model", classmethod(refuse))


@pytest.mark.parametrize("template, problem", [
    (BROKEN, "unexpected '}'"),
    ("{% for m in messages %}{{ m.content }}", "Unexpected end of template"),
    ("{{ messages[0]['content'] }", "unexpected '}'"),
])
def test_broken_template_string_refused_at_startup(ckpt, no_load, template, problem):
    result = CliRunner().invoke(app, ["serve", ckpt, "--port", "0", "--device", "cpu",
                                      "--chat-template", template])
    out = result.output  # click mixes stderr into output
    assert result.exit_code == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("error: --chat-template is not a valid Jinja template (line 1): ")
    assert problem in lines[0]
    assert "Traceback" not in out and "loading" not in out


def test_broken_template_file_names_the_file_and_line(tmp_path, ckpt, no_load):
    f = tmp_path / "chat.jinja"
    f.write_text("{% for m in messages %}\n{{ m.content }}\n{% endif %}\n")
    result = CliRunner().invoke(app, ["serve", ckpt, "--port", "0", "--device", "cpu",
                                      "--chat-template", str(f)])
    out = result.output  # click mixes stderr into output
    assert result.exit_code == 1, out
    assert f"error: chat template file {f} is not a valid Jinja template (line 3): " in out
    assert "endif" in out


def test_valid_templates_still_load(tmp_path):
    good = "{% for m in messages %}{{ m.content }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    assert load_chat_template(good) == good  # loop controls: the extension transformers enables
    compile_chat_template("{{ raise_exception('x') if false }}{{ messages | tojson }}")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        compile_chat_template(BROKEN)
