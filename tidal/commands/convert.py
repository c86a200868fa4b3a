"""`tidal convert SRC OUT`: write a model as an FTW directory (tidal/weights/ftw.py);
`tidal convert --verify DIR`: check an FTW directory's checksums."""
from __future__ import annotations

import sys


def configure(p) -> None:
    p.description = ("Convert a Hugging Face model directory or a .gguf file to Tidal's fast weight format "
                     "(FTW): expert banks laid out as the host pool holds them, read straight into memory "
                     "at load. Streams one expert at a time (needs no GPU and little RAM) and writes "
                     "OUT.partial/ first, renamed to OUT when complete. Load the result with "
                     "--model OUT (format detected by its ftw.json).")
    p.add_argument("src", help="Hugging Face model directory or .gguf file (with --verify and no OUT: "
                               "the FTW directory to check)")
    p.add_argument("out", nargs="?", default=None, help="output FTW directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="store floating tensors in this dtype (auto: as in SRC; quantised GGUF tensors: "
                        "the GGUF's natural dtype, bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (only once the new one "
                                                            "is complete)")
    p.add_argument("--verify", action="store_true", help="check every region's checksum (of OUT after "
                                                         "converting, or of SRC when OUT is not given)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tidal.config import parse_dtype
    from tidal.errors import ConfigError
    from tidal.weights.ftw import convert, verify_dir

    progress = sys.stderr.isatty()
    if args.out is None:
        if not args.verify:
            raise ConfigError("tidal convert needs SRC and OUT (or --verify DIR to check an FTW directory)")
        checked = verify_dir(args.src, progress=progress)
        print(f"{args.src}: OK ({checked / 1e9:.2f} GB, every checksum matches)", file=sys.stderr)
        return 0
    out = convert(args.src, args.out, dtype=parse_dtype(args.dtype), overwrite=args.overwrite, progress=progress)
    print(f"wrote {out}", file=sys.stderr)
    if args.verify:
        checked = verify_dir(out, progress=progress)
        print(f"{out}: OK ({checked / 1e9:.2f} GB, every checksum matches)", file=sys.stderr)
    return 0
