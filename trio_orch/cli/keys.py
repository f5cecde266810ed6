"""``trio-orch keys DIR``: the CurveZMQ key pairs of a head and its workers.

Writes ``DIR/head.key`` (public: give it to every worker) and
``DIR/head.key_secret`` (the head's only), and ``DIR/workers/worker-N.key``
(the head's allow-list) / ``.key_secret`` (one per worker host).
"""

from __future__ import annotations

import argparse
import sys

from stages.auth import KeysError, generate_keys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory to write the keys to (created, mode 0700)")
    parser.add_argument(
        "--workers", type=int, default=2, metavar="N", help="worker key pairs to make (default 2)"
    )
    parser.add_argument("--force", action="store_true", help="replace keys already in DIR")


def run(args: argparse.Namespace) -> int:
    try:
        files = generate_keys(args.dir, args.workers, force=args.force)
    except (KeysError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(files)} key files to {args.dir}: head.key (give to workers), head.key_secret (the "
        f"head's), workers/worker-1..{args.workers} (.key: the head's allow-list; .key_secret: one per "
        "worker)"
    )
    return 0
