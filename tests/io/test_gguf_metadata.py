"""`deltalens.io.gguf.read_metadata` (the standard-library GGUF header reader) and `gguf_bos` (a GGUF's
add_bos_token flag applied to its tokenizer): known answers against files written by the gguf package's own
writer, refusals of broken headers, and the tokenizer that cannot follow the flag."""

from __future__ import annotations

import numpy as np
import pytest

from deltalens.errors import DeltalensError
from deltalens.io.gguf import read_metadata
from deltalens.io.models import GGUF_ADD_BOS, gguf_bos

gguf = pytest.importorskip("gguf", reason="the gguf package writes the fixture files (pip install 'deltalens[gguf]')")


def write(path, add_bos=True):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_token_list([f"tok{i}" for i in range(1000)])  # a string array before the flags, as real files have
    w.add_token_scores([0.5] * 1000)  # a float array
    w.add_bos_token_id(7)
    w.add_add_bos_token(add_bos)
    w.add_string("general.name", "fixture")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_gguf_writer_wrote_and_what_gguf_reader_reads(tmp_path):
    path = write(tmp_path / "m.gguf")
    keys = ["general.architecture", "llama.block_count", GGUF_ADD_BOS, "tokenizer.ggml.bos_token_id",
            "general.name", "no.such.key"]
    got = read_metadata(path, keys)
    assert got == {"general.architecture": "llama", "llama.block_count": 2, GGUF_ADD_BOS: True,
                   "tokenizer.ggml.bos_token_id": 7, "general.name": "fixture"}
    ref = gguf.GGUFReader(str(path)).fields
    for k, v in got.items():
        assert ref[k].contents() == v, k
    assert read_metadata(write(tmp_path / "f.gguf", add_bos=False), [GGUF_ADD_BOS]) == {GGUF_ADD_BOS: False}


@pytest.mark.parametrize("cut, message", [
    (lambda b: b"GGML" + b[4:], "no GGUF magic"),
    (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], "GGUF version 99"),
    (lambda b: b[:200], "ends early|runs past the end"),
])
def test_broken_headers_are_refused_in_one_line(tmp_path, cut, message):
    good = write(tmp_path / "m.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(cut(good))
    with pytest.raises(DeltalensError, match=message) as e:
        read_metadata(bad, [GGUF_ADD_BOS])
    assert "\n" not in str(e.value)


class Tok:
    """A tokenizer as transformers' are to `gguf_bos`: add_bos_token, bos_token_id, __call__."""

    def __init__(self, add_bos, follows=True):
        self._add, self.follows, self.bos_token_id = add_bos, follows, 7

    @property
    def add_bos_token(self):
        return self._add

    @add_bos_token.setter
    def add_bos_token(self, value):
        if self.follows:
            self._add = value

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([7] if self._add and add_special_tokens else []) + [100]}


@pytest.mark.parametrize("flag", [True, False])
def test_the_tokenizer_is_made_to_follow_the_files_flag(tmp_path, flag):
    path = write(tmp_path / "m.gguf", add_bos=flag)
    tok = Tok(add_bos=not flag)  # transformers converted it the other way (5.19 and Gemma 3: no BOS)
    gguf_bos(tok, path)
    assert tok.add_bos_token is flag and (tok("x")["input_ids"][0] == 7) is flag


def test_a_tokenizer_that_cannot_follow_the_flag_is_refused(tmp_path):
    with pytest.raises(DeltalensError, match="add_bos_token=True.*cannot be made to follow it"):
        gguf_bos(Tok(add_bos=False, follows=False), write(tmp_path / "m.gguf"))
