"""The export stage's command: `soarm export`."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint to a self-describing ONNX policy")
    p.add_argument("source", type=Path, help="checkpoint model_N.pt or run directory (its newest checkpoint)")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="the ONNX file to write (default: policy.onnx beside the checkpoint)")
    p.add_argument("--verify", type=int, default=10_000, help="observations for the torch/onnxruntime check")
    p.set_defaults(fn=_export)


def _export(args) -> int:
    from soarm.export.exporter import TOLERANCE, export
    from soarm.training import checkpoint

    out = args.out or checkpoint.resolve(args.source).parent / "policy.onnx"
    print(f"exporting {args.source} -> {out}")
    r = export(args.source, out, verify_count=args.verify)
    print(f"verified on {r['observations']} observations: max |torch - onnxruntime| = {r['parity_max_abs']:.2e} "
          f"(tolerance {TOLERANCE:.0e})")
    print(f"wrote {r['path']} ({r['bytes'] / 1024:.0f} KiB, iteration {r['iteration']} of {r['checkpoint']})")
    return 0
