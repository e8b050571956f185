"""Write a copy of a llama-arch GGUF that keeps only its first N decoder layers (real weights, byte for
byte; metadata and tokenizer unchanged but the block count).

The GPU lane runs the default model; where its 98 MB file cannot travel to the GPU machine (the device
tool's 64 MiB limit), the lane runs on such a copy instead: `RAYLLM_GPU_TEST_GGUF=path pytest -m gpu`
(tests/gpu/conftest.py). Usage: python tests/gpu/trim_gguf.py SRC DST --layers 6
"""

from __future__ import annotations

import argparse

import gguf


def trim(src: str, dst: str, layers: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    writer = gguf.GGUFWriter(dst, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    trim(args.src, args.dst, args.layers)


if __name__ == "__main__":
    main()
