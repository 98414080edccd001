"""`kpipe pack`: an image folder into sharded HDF5 files of encoded JPEG bytes.

    $ kpipe pack photos/train packed/train --max-side 256
    $ kpipe pack photos/train packed/train --max-side 256   # after an interruption: resumes

Read the shards with `kpipe.data.from_packed("packed/train-*.h5", ...)`.
"""

import sys

HELP = "pack an image folder into sharded HDF5 files of JPEG bytes (resumable)"


def add_arguments(parser):
    parser.description = ("Write an image folder (one sub-folder per class) into sharded HDF5 files of encoded "
                          "JPEG bytes, labels and class names, for kpipe.data.from_packed. Each image is decoded "
                          "once to check it; complete shards of an earlier run with the same settings are kept.")
    parser.add_argument("directory", help="the image folder")
    parser.add_argument("output_prefix", help="path prefix of the shards, e.g. packed/train")
    parser.add_argument("--max-side", type=int, default=None, help="re-encode images larger than this on their longer side. Default: keep")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images. Default: 90")
    parser.add_argument("--shard-size", type=int, default=1000, help="images per shard. Default: 1000")
    parser.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                        help="a file that cannot be read or decoded: stop naming it, or leave it out. Default: raise")
    parser.add_argument("--no-validate", action="store_true", help="store JPEG files without decoding them first")


def run(args):
    from kpipe.data._pack import pack

    try:
        out = pack(args.directory, args.output_prefix, max_side=args.max_side, quality=args.quality,
                   shard_size=args.shard_size, validate=not args.no_validate, on_error=args.on_error)
    except (ValueError, FileNotFoundError) as e:
        print(f"kpipe pack: {e}", file=sys.stderr)
        return 1
    print(f"kpipe pack: {out['images']} images in {len(out['shards'])} shards ({out['reused']} kept from an earlier run), "
          f"{len(out['skipped'])} skipped, {len(out['class_names'])} classes")
    return 0
