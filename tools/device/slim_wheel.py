"""onnxruntime-gpu's wheel for one GPU architecture: its CUDA provider's kernels for the others zeroed.

The wheel is 255 MB, almost all of it libonnxruntime_providers_cuda.so, whose fatbins hold a compressed cubin per
architecture (7.5, 8.0, 8.6, 8.9, 9.0, 12.0 in 1.31.1, no PTX).  The driver loads the cubin of the GPU's own
architecture and reads no other, so the others' payloads can be zeroed in place (the headers, sizes and offsets
stay as they were): for an H100 (9.0) the wheel is 114 MB, two device calls instead of five.  Only the payload
bytes change, so the library's layout is the one ONNX Runtime built.

    python tools/device/slim_wheel.py WHEEL OUT_WHEEL [ARCH]     # ARCH: 90 (the default) for Hopper
"""

from __future__ import annotations

import base64
import hashlib
import struct
import sys
import zipfile
from pathlib import Path

CUDA_PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def zero_other_architectures(library: bytearray, keep: int) -> tuple[int, int]:
    """Zero, in place, the payload of every fatbin entry whose architecture is not `keep`; (bytes kept, zeroed).

    A fatbin: magic, version 1, header size 16, then its entries' total size; each entry: kind, version, its header's
    size (at 4), its payload's size (at 8), its architecture as major*10+minor (at 28), then the payload."""
    kept = zeroed = 0
    position = 0
    while (start := library.find(FATBIN_MAGIC, position)) >= 0:
        version, header, size = struct.unpack_from("<HHQ", library, start + 4)
        if (version, header) != (1, 16):  # the magic's bytes inside something else
            position = start + 4
            continue
        entry, end = start + 16, start + 16 + size
        while entry < end:
            (entry_header,) = struct.unpack_from("<I", library, entry + 4)
            (payload,) = struct.unpack_from("<Q", library, entry + 8)
            (architecture,) = struct.unpack_from("<I", library, entry + 28)
            body = entry + entry_header
            if architecture == keep:
                kept += payload
            else:
                library[body : body + payload] = bytes(payload)
                zeroed += payload
            entry = body + payload
        position = end
    return kept, zeroed


def slim(wheel: Path, target: Path, keep: int = 90) -> tuple[int, int]:
    """`wheel` rewritten as `target` with only `keep`'s kernels in its CUDA provider (RECORD's hash updated)."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        library = bytearray(source.read(CUDA_PROVIDER))
        counts = zero_other_architectures(library, keep)
        digest = base64.urlsafe_b64encode(hashlib.sha256(library).digest()).rstrip(b"=").decode()
        for info in source.infolist():
            body = bytes(library) if info.filename == CUDA_PROVIDER else source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = body.decode().splitlines()
                mine = f"{CUDA_PROVIDER},sha256={digest},{len(library)}"
                body = "".join(f"{mine if line.startswith(CUDA_PROVIDER + ',') else line}\n" for line in lines).encode()
            out.writestr(info, body, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return counts


if __name__ == "__main__":
    kept, zeroed = slim(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 90)
    print(f"kept {kept >> 20} MiB of cubins, zeroed {zeroed >> 20} MiB")
