"""A truncated checkpoint file fails with one clear error naming the checkpoint (orbax and HF safetensors)."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from pdjax.models.checkpoint import CHECKSUM_FILE, CheckpointCorruptError, load_model, save_hf_checkpoint, save_params

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = REPO / "checkpoints" / "tiny-byte"


def _truncate(path: pathlib.Path, fraction: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * fraction))


@pytest.fixture
def orbax_copy(tmp_path):
    dst = tmp_path / "tiny-byte"
    shutil.copytree(TINY, dst)
    return dst


def _largest_data_file(ckpt: pathlib.Path) -> pathlib.Path:
    return max((p for p in (ckpt / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _check(error: CheckpointCorruptError, ckpt: pathlib.Path, what: str) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"checkpoint {str(ckpt)!r} is truncated or corrupt" in message
    assert what in message
    assert error.__cause__ is not None        # the reader's own error is kept


def test_truncated_orbax_data_file(orbax_copy):
    _truncate(_largest_data_file(orbax_copy))
    with pytest.raises(CheckpointCorruptError) as info:
        load_model(str(orbax_copy))
    _check(info.value, orbax_copy, "restoring params/ with orbax failed")
    assert "OUT_OF_RANGE" in str(info.value)     # TensorStore's useful line, not its spec dump
    assert "TensorStore({" not in str(info.value)


@pytest.mark.parametrize("rel", ["pdjax_spec.json", "params/_METADATA", "params/manifest.ocdbt"])
def test_truncated_orbax_metadata_files(orbax_copy, rel):
    _truncate(orbax_copy / rel)
    with pytest.raises(CheckpointCorruptError) as info:
        load_model(str(orbax_copy))
    _check(info.value, orbax_copy, "pdjax_spec.json" if rel == "pdjax_spec.json" else "orbax")


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    spec, params = load_model(str(TINY))
    out = {}
    for shards in (1, 2):
        d = tmp_path_factory.mktemp(f"hf{shards}")
        save_hf_checkpoint(d, spec, params, num_shards=shards)
        (d / CHECKSUM_FILE).unlink()   # these test the readers' own errors, as for a checkpoint made elsewhere
        out[shards] = d
    return out


@pytest.mark.parametrize("shards,rel,what", [
    (1, "model.safetensors", "opening model.safetensors"),
    (2, "model-00002-of-00002.safetensors", "opening model-00002-of-00002.safetensors"),
    (2, "model.safetensors.index.json", "reading model.safetensors.index.json"),
    (1, "config.json", "reading config.json"),
])
def test_truncated_hf_files(tmp_path, hf_source, shards, rel, what):
    ckpt = tmp_path / "hf"
    shutil.copytree(hf_source[shards], ckpt)
    _truncate(ckpt / rel)
    with pytest.raises(CheckpointCorruptError) as info:
        load_model(str(ckpt))
    _check(info.value, ckpt, what)


def test_hf_tensor_data_cut_inside_the_file(tmp_path, hf_source):
    """Header intact, tensor bytes cut off: the header promises more bytes than the file has; fails naming it."""
    ckpt = tmp_path / "hf"
    shutil.copytree(hf_source[1], ckpt)
    path = ckpt / "model.safetensors"
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    _truncate(path, (8 + header_len + 16) / path.stat().st_size)     # header intact, data almost all gone
    with pytest.raises(CheckpointCorruptError, match="model.safetensors"):
        load_model(str(ckpt))


def test_generate_cli_names_the_truncated_checkpoint_in_one_line(orbax_copy, tmp_path):
    _truncate(_largest_data_file(orbax_copy))
    (tmp_path / "p.json").write_text(json.dumps([[1, 2, 3]]))
    out = subprocess.run([sys.executable, "-m", "experiments.generate", f"--checkpoint={orbax_copy}",
                          f"--prompts={tmp_path / 'p.json'}", f"--out={tmp_path / 'o.json'}"],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {str(orbax_copy)!r} is truncated or corrupt")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("spec_text", ['{"name": "x"}', '[1, 2]', '{"name": "x", "vocab_size": 259, "colour": 1}'])
def test_a_spec_file_that_is_not_a_spec_is_named(orbax_copy, spec_text):
    """Valid JSON that is not a ModelSpec (missing or unknown keys, not an object): the file is named, one line."""
    (orbax_copy / "pdjax_spec.json").write_text(spec_text)
    with pytest.raises(CheckpointCorruptError) as info:
        load_model(str(orbax_copy))
    _check(info.value, orbax_copy, "reading pdjax_spec.json failed")


def test_checkpoint_errors_are_user_errors(tmp_path):
    from pdjax.errors import UserError
    assert issubclass(CheckpointCorruptError, UserError)
    for bad in ("/nonexistent/ckpt", str(tmp_path)):      # not a directory; a directory with neither format
        with pytest.raises(UserError):
            load_model(bad)


@pytest.mark.parametrize("fmt", ["orbax", "hf"])
def test_a_flipped_bit_is_refused_naming_the_file(tmp_path, fmt):
    """issue 27 item 7: a 1-bit flip in a checkpoint file was served (it still decodes). Saving records every file's
    SHA-256 (CHECKSUM_FILE); loading checks them, naming the file; verify_checksums=False loads it anyway."""
    spec, params = load_model(str(TINY))
    ckpt = tmp_path / fmt
    (save_params if fmt == "orbax" else save_hf_checkpoint)(ckpt, spec, params)
    manifest = json.loads((ckpt / CHECKSUM_FILE).read_text())
    assert manifest and all(len(digest) == 64 for digest in manifest.values())
    load_model(str(ckpt))
    target = _largest_data_file(ckpt) if fmt == "orbax" else ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) - 9] ^= 0x01              # inside the tensor bytes: the file still reads
    target.write_bytes(bytes(data))
    name = str(target.relative_to(ckpt))
    with pytest.raises(CheckpointCorruptError, match=rf"{name!r} does not match its SHA-256"):
        load_model(str(ckpt))
    load_model(str(ckpt), verify_checksums=False)
    target.unlink()
    with pytest.raises(CheckpointCorruptError, match=rf"lacks {name!r}"):
        load_model(str(ckpt))
