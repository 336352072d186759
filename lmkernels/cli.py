"""Command line: `lmkernels check | bench <suite>... | info`."""

import argparse
import os
import sys


def _check(args):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    from . import check

    return check.run()


def _bench(args):
    from . import bench

    return bench.main(args.suites, results_dir=args.results_dir, markdown_path=args.markdown, quick=args.quick)


def _info(args):
    import torch
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        print("no CUDA GPU: ops run their PyTorch reference (TRITON_INTERPRET=1 runs the Triton kernels on CPU)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lmkernels", description="Triton kernels for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="run every op against its reference on this device").set_defaults(func=_check)
    b = sub.add_parser("bench", help="benchmark suites on the GPU against peers and measured ceilings")
    b.add_argument("suites", nargs="+", help="suite names (norm, activation, rope, all, sweep)")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.add_argument("--results-dir", default="benchmarks/results")
    b.add_argument("--markdown", default="BENCHMARKS.md")
    b.set_defaults(func=_bench)
    sub.add_parser("info", help="versions and device").set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
