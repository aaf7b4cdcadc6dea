"""Fixes from a fresh-clone README walkthrough (session 5): messages for a mistyped local path."""

from __future__ import annotations

from typer.testing import CliRunner

from atomtool.cli import app


def test_bare_name_that_is_neither_a_directory_nor_a_cached_repo_says_both(tmp_path, monkeypatch):
    """`atomtool inspect nope` reads `nope` as a Hub repo id only because no such directory exists; the error
    says so, so a mistyped local path is recognisable (offline here: no network in tests)."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: patch the constant, not the env
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    res = CliRunner().invoke(app, ["inspect", "nope"])
    assert res.exit_code == 1
    assert "nope: no local directory by that name; as a Hub repo id: HF_HUB_OFFLINE is set" in res.output


def test_relative_model_directory_that_does_not_exist_names_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["generate", "./nope", "--prompt", "hi", "--device", "cpu"])
    assert res.exit_code == 1
    assert f"model directory 'nope' does not exist (as given: a path relative to the current directory " \
           f"{str(tmp_path)!r})" in res.output
