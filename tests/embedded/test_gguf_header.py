"""The GGUF header read once per file version and kept on disk: what it gives is the gguf package's reader's,
field for field and byte for byte, and a later reader takes it from the disk instead of parsing again."""
import json
import os
import shutil

import gguf
import numpy as np
import pytest

from autotune.embedded import gguf_header
from autotune.embedded.bundled import bundled_gguf_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    gguf_header._read.cache_clear()  # each read below goes to the disk, as a new process's would
    yield tmp_path / "cache" / "gguf"
    gguf_header._read.cache_clear()


def test_the_header_is_the_gguf_readers_fields_and_tensor_bytes(cache):
    reader = gguf.GGUFReader(bundled_gguf_path())
    for _ in range(2):  # parsed and stored, then read back from the stored copy
        header = gguf_header.read_header(bundled_gguf_path())
        assert header.meta == {k: f.contents() for k, f in reader.fields.items()}
        assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
            assert (ours.tensor_type, list(ours.shape), ours.n_elements, ours.n_bytes) == (
                theirs.tensor_type, list(theirs.shape), theirs.n_elements, theirs.n_bytes)
            assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
            assert np.array_equal(ours.data, theirs.data)
        gguf_header._read.cache_clear()
    assert {t.tensor_type.name for t in header.tensors} >= {"F32", "Q4_1"}  # numbers and blocks both checked
    assert len(list(cache.glob("*.json"))) == 1


def test_a_later_reader_takes_the_stored_header_and_a_changed_file_is_parsed_again(cache, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copyfile(bundled_gguf_path(), model)
    gguf_header.read_header(model)
    (stored,) = cache.glob("*.json")
    doc = json.loads(stored.read_text())
    doc["meta"]["general.name"] = "written by this test"  # what only the stored copy says
    stored.write_text(json.dumps(doc))
    gguf_header._read.cache_clear()
    assert gguf_header.read_header(model).meta["general.name"] == "written by this test"

    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 1_000_000_000))  # a new version
    gguf_header._read.cache_clear()
    assert gguf_header.read_header(model).meta["general.name"] != "written by this test"
    assert len(list(cache.glob("*.json"))) == 2


def test_junk_is_a_one_line_error_and_leaves_nothing_stored(cache, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match=r"junk.gguf is not a readable GGUF file \(") as e:
        gguf_header.read_header(junk)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_header.read_header(tmp_path / "missing.gguf")
    assert not cache.exists() or not list(cache.iterdir())
