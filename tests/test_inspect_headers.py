"""Hostile and corrupt safetensors headers: every case gives one HeaderError line naming file and problem.

Files are crafted byte by byte (8-byte little-endian length + JSON + data). Valid files come from
safetensors' own writer, and the Rust reader (safe_open) is the oracle for what a valid header means.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from atomtool.errors import HeaderError
from atomtool.inspect import safetensors_header as sh
from atomtool.inspect.safetensors_header import (
    MAX_HEADER_BYTES,
    parse_header_bytes,
    read_header_file,
)


def craft(header: bytes | str | dict, data: bytes | int = 0, *, declared: int | None = None) -> bytes:
    """Length prefix + header bytes + data (bytes, or that many zero bytes)."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if declared is None else declared
    body = data if isinstance(data, bytes) else b"\0" * data
    return struct.pack("<Q", n) + header + body


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def write(tmp_path: Path, blob: bytes, name: str = "model.safetensors") -> Path:
    p = tmp_path / name
    p.write_bytes(blob)
    return p


def expect_error(path: Path, *needles: str) -> str:
    with pytest.raises(HeaderError) as ei:
        read_header_file(path)
    msg = str(ei.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# ---------------------------------------------------------------- valid files


def test_reads_file_written_by_safetensors(tmp_path):
    tensors = {
        "model.embed_tokens.weight": torch.zeros(7, 4, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(6, 4, dtype=torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.zeros(1, 1, dtype=torch.float32),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 5, dtype=torch.float16),
    }
    p = tmp_path / "model.safetensors"
    save_file(tensors, p, metadata={"format": "pt"})
    hdr = read_header_file(p)
    assert hdr.metadata == {"format": "pt"}
    assert hdr.data_start + hdr.data_len == p.stat().st_size
    with safe_open(p, "pt") as f:
        assert set(hdr.tensors) == set(f.keys())
        for name in f.keys():
            info = hdr.tensors[name]
            assert list(info.shape) == f.get_slice(name).get_shape()
            assert info.dtype == f.get_slice(name).get_dtype()
            assert info.file == "model.safetensors"
            assert info.nbytes == tensors[name].numel() * tensors[name].element_size()


def test_sub_byte_and_zero_sized_tensors(tmp_path):
    # F4 counts logical elements (two per byte); zero-sized tensors may share an offset.
    hdr = {"a": entry("F4", [4, 6], 0, 12), "z1": entry("BF16", [0], 12, 12), "z2": entry("F32", [3, 0], 12, 12),
           "b": entry("F6_E2M3", [4], 12, 15)}
    p = write(tmp_path, craft(hdr, 15))
    got = read_header_file(p, file="shard.safetensors")
    assert got.tensors["a"].shape == (4, 6) and got.tensors["a"].nbytes == 12
    assert got.tensors["b"].file == "shard.safetensors"
    with safe_open(p, "pt") as f:  # the reference reader agrees the file is valid
        assert set(f.keys()) == set(hdr)


def test_reads_only_prefix_and_header(tmp_path, monkeypatch):
    hdr = craft({"w": entry("BF16", [1024, 1024], 0, 2 * 1024 * 1024)}, 2 * 1024 * 1024)
    p = write(tmp_path, hdr)
    n = struct.unpack("<Q", hdr[:8])[0]
    read = []

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

        def fileno(self):
            return self.fh.fileno()

        def read(self, k=-1):
            b = self.fh.read(k)
            read.append(len(b))
            return b

    monkeypatch.setattr(sh, "open", lambda path, mode: Counting(open(path, mode)), raising=False)
    read_header_file(p)
    assert sum(read) == 8 + n


# ---------------------------------------------------------------- length prefix


def test_file_shorter_than_prefix(tmp_path):
    expect_error(write(tmp_path, b"\x05\x00\x00"), "3 bytes", "shorter than the 8-byte")


def test_declared_length_zero(tmp_path):
    expect_error(write(tmp_path, craft(b"", 0, declared=0)), "header length is 0")


def test_declared_length_past_end_of_file(tmp_path):
    blob = craft({"w": entry("U8", [4], 0, 4)}, 4, declared=10_000)
    expect_error(write(tmp_path, blob), "declared header length 10000 bytes", "past the end of the file")


@pytest.mark.parametrize("declared", [MAX_HEADER_BYTES + 1, 2**64 - 1])
def test_declared_length_absurdly_large(tmp_path, declared):
    expect_error(write(tmp_path, craft("{}", 0, declared=declared)), f"{declared} bytes", "exceeds",
                 str(MAX_HEADER_BYTES))


# ---------------------------------------------------------------- JSON level


def test_header_not_utf8(tmp_path):
    expect_error(write(tmp_path, craft(b'{"w\xff\xfe": 1}')), "not valid UTF-8")


@pytest.mark.parametrize("text", ['{"w": {"dtype": "U8",', "{not json}", '{"a": 1} trailing', '{"a": NaN}',
                                  '{"a": [' + "9" * 5000 + "]}"])
def test_header_not_json(tmp_path, text):
    expect_error(write(tmp_path, craft(text)), "not valid JSON")


def test_header_deeply_nested(tmp_path):
    expect_error(write(tmp_path, craft('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")),
                 "not valid JSON", "nesting too deep")


@pytest.mark.parametrize("text", ["[1, 2]", '"model"', "42", " {}"])
def test_top_level_not_object(tmp_path, text):
    expect_error(write(tmp_path, craft(text)), "not a JSON object")


def test_duplicate_tensor_names(tmp_path):
    a = json.dumps(entry("U8", [2], 0, 2))
    b = json.dumps(entry("U8", [2], 2, 4))
    text = f'{{"layers.0.w": {a}, "layers.0.w": {b}}}'
    expect_error(write(tmp_path, craft(text, 4)), "duplicate tensor name 'layers.0.w'")


def test_duplicate_key_inside_entry(tmp_path):
    text = '{"w": {"dtype": "U8", "dtype": "F32", "shape": [2], "data_offsets": [0, 2]}}'
    expect_error(write(tmp_path, craft(text, 2)), "tensor 'w'", "duplicate key 'dtype'")


def test_duplicate_metadata(tmp_path):
    text = '{"__metadata__": {"format": "pt"}, "__metadata__": {}}'
    expect_error(write(tmp_path, craft(text)), "duplicate '__metadata__'")
    text = '{"__metadata__": {"format": "pt", "format": "np"}}'
    expect_error(write(tmp_path, craft(text), "b.safetensors"), "duplicate key 'format'", "__metadata__")


@pytest.mark.parametrize("meta, needle", [([1, 2], "not an object"), ("pt", "not an object"),
                                          ({"format": 1}, "'format' is a number, not a string"),
                                          ({"nested": {"a": "b"}}, "'nested' is an object, not a string")])
def test_metadata_not_str_to_str(tmp_path, meta, needle):
    expect_error(write(tmp_path, craft({"__metadata__": meta})), "'__metadata__'", needle)


# ---------------------------------------------------------------- tensor entries


def test_entry_not_an_object(tmp_path):
    expect_error(write(tmp_path, craft({"w": [0, 4]})), "tensor 'w'", "not an object")


@pytest.mark.parametrize("missing", ["dtype", "shape", "data_offsets"])
def test_entry_missing_key(tmp_path, missing):
    e = entry("U8", [4], 0, 4)
    del e[missing]
    expect_error(write(tmp_path, craft({"w": e}, 4)), "tensor 'w'", f"missing '{missing}'")


@pytest.mark.parametrize("dtype", ["F8_E4M3FN", "Q4", "bf16", "", 7, None])
def test_unknown_dtype(tmp_path, dtype):
    expect_error(write(tmp_path, craft({"w": entry(dtype, [4], 0, 4)}, 4)), "tensor 'w'",
                 f"unknown dtype {dtype!r}")


@pytest.mark.parametrize("shape", [[-1, 4], [2.0, 2], [True, 4], ["4"], 4, {"a": 1}, [[2], [2]]])
def test_bad_shape(tmp_path, shape):
    expect_error(write(tmp_path, craft({"w": entry("U8", shape, 0, 4)}, 4)), "tensor 'w'",
                 "not a list of non-negative integers")


@pytest.mark.parametrize("offsets", [[0], [0, 4, 8], [-4, 0], [0.0, 4], "0-4", [0, None], {"a": 0, "b": 4}])
def test_data_offsets_not_a_pair(tmp_path, offsets):
    hdr = {"w": {"dtype": "U8", "shape": [4], "data_offsets": offsets}}
    expect_error(write(tmp_path, craft(hdr, 4)), "tensor 'w'", "not a pair of non-negative integers")


def test_begin_after_end(tmp_path):
    expect_error(write(tmp_path, craft({"w": entry("U8", [0], 8, 4)}, 8)), "tensor 'w'", "begin 8 > end 4")


def test_byte_count_not_numel_times_dtype_size(tmp_path):
    msg = expect_error(write(tmp_path, craft({"w": entry("BF16", [4, 4], 0, 16)}, 16)), "tensor 'w'")
    assert "span 16 bytes" in msg and "needs 32" in msg


def test_sub_byte_not_whole_bytes(tmp_path):
    expect_error(write(tmp_path, craft({"w": entry("F4", [3], 0, 2)}, 2)), "tensor 'w'",
                 "not a whole number of bytes")


def test_overlapping_offsets(tmp_path):
    hdr = {"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 4, 12)}
    expect_error(write(tmp_path, craft(hdr, 12)), "tensor 'b'", "overlap", "tensor 'a'")


def test_same_offsets_twice(tmp_path):
    hdr = {"a": entry("U8", [8], 0, 8), "b": entry("I8", [8], 0, 8)}
    expect_error(write(tmp_path, craft(hdr, 8)), "overlap")


def test_hole_between_tensors(tmp_path):
    hdr = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 8, 12)}
    expect_error(write(tmp_path, craft(hdr, 12)), "hole", "[4, 8)")


def test_first_tensor_not_at_zero(tmp_path):
    expect_error(write(tmp_path, craft({"a": entry("U8", [4], 4, 8)}, 8)), "hole", "at the start")


def test_offsets_beyond_end_of_file(tmp_path):
    hdr = {"a": entry("U8", [4], 0, 4), "b": entry("F32", [1000], 4, 4004)}
    expect_error(write(tmp_path, craft(hdr, 100)), "tensor 'b'", "end 4004", "beyond the data section",
                 "100 bytes")


def test_trailing_bytes_after_last_tensor(tmp_path):
    expect_error(write(tmp_path, craft({"a": entry("U8", [4], 0, 4)}, 20)), "16 trailing bytes")


def test_hostile_name_keeps_message_on_one_line(tmp_path):
    name = "evil\nname\r" + "x" * 10_000
    msg = expect_error(write(tmp_path, craft({name: entry("Q9", [1], 0, 1)}, 1)), "unknown dtype 'Q9'")
    assert len(msg) < 400


def test_parse_header_bytes_checks_truncated_blob():
    with pytest.raises(HeaderError, match=r"^remote\.safetensors: declared header length 50 bytes runs past"):
        parse_header_bytes(craft("{}", 0, declared=50), file="remote.safetensors")


# ---------------------------------------------------------------- properties


def _safetensors_accepts(blob: bytes) -> dict | None:
    """What the Rust reference reader makes of the file: {name: (dtype, shape)}, or None if it rejects."""
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
        try:
            with safe_open(path, "pt") as f:
                return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception:
            return None
    finally:
        os.unlink(path)


def _check(blob: bytes) -> None:
    """Our parser either accepts (and then so does safetensors, with the same tensors) or raises HeaderError."""
    try:
        got = parse_header_bytes(blob, file="f.safetensors", file_size=len(blob))
    except HeaderError as e:
        msg = str(e)
        assert msg.startswith("f.safetensors: ") and "\n" not in msg and "\r" not in msg
        return
    ref = _safetensors_accepts(blob)
    assert ref is not None, "we accepted a header safetensors rejects"
    assert ref == {k: (v.dtype, v.shape) for k, v in got.tensors.items()}
    assert got.data_start + got.data_len == len(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_header_error(blob):
    _check(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 64))
def test_random_header_body_with_plausible_length(body, extra):
    _check(struct.pack("<Q", len(body)) + body + b"\0" * extra)


_VALID = craft(
    {"__metadata__": {"format": "pt"}, "model.w": entry("BF16", [2, 3], 0, 12),
     "model.s": entry("F32", [1], 12, 16), "model.q": entry("F8_E4M3", [4], 16, 20)},
    20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(0, len(_VALID) - 1),
                          st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_valid_file_only_header_error(edits):
    blob = bytearray(_VALID)
    for op, pos, byte in edits:
        pos %= max(len(blob), 1)
        if op == "flip" and blob:
            blob[pos] = byte
        elif op == "insert":
            blob.insert(pos, byte)
        elif blob:
            del blob[pos]
    _check(bytes(blob))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=False) | st.sampled_from(
        ["BF16", "F32", "U8", "F4", "Q4", "__metadata__", "dtype", "shape", "data_offsets"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["w", "b", "dtype", "shape", "data_offsets", "__metadata__", "format"]), children,
        max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["w", "b", "__metadata__"]), _json_values, max_size=3), st.integers(0, 48))
def test_random_json_headers_only_header_error(hdr, data_len):
    _check(craft(hdr, data_len))


@st.composite
def _near_valid(draw):
    """A header laid out like safetensors writes it, then possibly nudged by one small error."""
    n = draw(st.integers(0, 4))
    hdr, off = {}, 0
    for i in range(n):
        dtype = draw(st.sampled_from(["BF16", "F32", "U8", "F4", "F6_E3M2", "I64", "F8_E4M3"]))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        size = numel * sh.DTYPE_BITS[dtype] // 8
        hdr[f"t{i}"] = entry(dtype, shape, off, off + size)
        off += size
    if hdr and draw(st.booleans()):
        e = hdr[draw(st.sampled_from(sorted(hdr)))]
        key = draw(st.sampled_from(["shape", "data_offsets"]))
        idx = draw(st.integers(0, 1))
        if e[key] and idx < len(e[key]):
            e[key][idx] = max(0, e[key][idx] + draw(st.sampled_from([-1, 1])))
    return hdr, off + draw(st.sampled_from([0, 0, 0, -1, 1]))


@settings(max_examples=300, deadline=None)
@given(_near_valid())
def test_near_valid_headers_agree_with_safetensors(case):
    # Without duplicate keys (a dict cannot hold them), our verdict equals the Rust reader's.
    hdr, data_len = case
    blob = craft(hdr, max(data_len, 0))
    try:
        got = parse_header_bytes(blob, file="f.safetensors", file_size=len(blob))
    except HeaderError:
        got = None
    ref = _safetensors_accepts(blob)
    assert (got is None) == (ref is None), (hdr, data_len, ref)
    if got is not None:
        assert ref == {k: (v.dtype, v.shape) for k, v in got.tensors.items()}


# ---------------------------------------------------------------- CLI: one line, exit 1, no traceback

_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 128}

_HOSTILE = {
    "past-eof": (craft({"w": entry("U8", [4], 0, 4)}, 4, declared=10_000), "runs past the end of the file"),
    "huge": (craft("{}", 0, declared=2**63), "exceeds the 100000000-byte limit"),
    "not-json": (craft("{oops"), "header is not valid JSON"),
    "duplicate": (craft('{"w": ' + json.dumps(entry("U8", [2], 0, 2)) + ', "w": '
                        + json.dumps(entry("U8", [2], 2, 4)) + "}", 4),
                  "duplicate tensor name 'w'"),
    "overlap": (craft({"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 4, 12)}, 12), "overlap"),
    "bytes": (craft({"w": entry("BF16", [4], 0, 4)}, 4), "needs 8"),
    "dtype": (craft({"w": entry("F8_E4M3FN", [4], 0, 4)}, 4), "unknown dtype 'F8_E4M3FN'"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_cli_inspect_hostile_header(tmp_path, case):
    from typer.testing import CliRunner

    from atomtool.cli import app

    blob, needle = _HOSTILE[case]
    (tmp_path / "config.json").write_text(json.dumps(_CONFIG))
    shard = write(tmp_path, blob)
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(app, ["inspect", str(tmp_path), *extra])
        assert result.exit_code == 1, result.output
        if extra:  # --json: the failure as one JSON object on stdout too (round 16)
            err = json.loads(result.stdout)["error"]
            assert err["type"] == "HeaderError" and result.stderr == f"error: {err['message']}\n"
        else:
            assert result.stdout == ""
        assert result.stderr.startswith(f"error: {shard}: ") and result.stderr.count("\n") == 1, result.stderr
        assert needle in result.stderr and "Traceback" not in result.stderr


def test_cli_inspect_hostile_header_subprocess(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(_CONFIG))
    shard = write(tmp_path, _HOSTILE["duplicate"][0])
    proc = subprocess.run([sys.executable, "-m", "atomtool.cli", "inspect", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: {shard}: duplicate tensor name 'w' in header\n"
