"""Command line: `lmkernels generate | check | bench <suite>... | info`."""

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


def _number(name, text, kind):
    if text is None:
        return None
    try:
        return kind(text)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what}, got {text!r}") from None


def _read_prompts(args) -> list:
    prompts = []
    if args.prompt is not None:
        prompts.append(args.prompt)
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as fh:
                lines = [line.rstrip("\n") for line in fh]
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--prompts-file {args.prompts_file} is not UTF-8 text") from None
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompts (one per line)")
        prompts += lines
    if not prompts:
        raise ValueError("give a prompt (lmkernels generate \"...\") or --prompts-file")
    for p in prompts:
        if not p.strip():
            raise ValueError("the prompt is empty")
    return prompts


def _run_generate(args) -> int:
    from .engine import Engine, SamplingParams

    params = SamplingParams(
        max_new_tokens=_number("--max-new-tokens", args.max_new_tokens, int),
        temperature=_number("--temperature", args.temperature, float),
        top_p=_number("--top-p", args.top_p, float), top_k=_number("--top-k", args.top_k, int),
        seed=_number("--seed", args.seed, int), stop=args.stop or None,
    )
    prompts = _read_prompts(args)
    engine = Engine.from_pretrained(args.model, device=args.device,
                                    use_cuda_graph=not args.no_cuda_graph)
    engine.warmup(min(len(prompts), engine.max_num_seqs))  # compile and capture outside the tokens/s figures
    single = len(prompts) == 1
    out = sys.stdout

    def show(ev):
        if single:
            if ev.text:
                out.write(ev.text)
                out.flush()
            if ev.finished:
                out.write("\n")
        elif ev.finished:
            o = ev.output
            out.write(f"[{o.index}] {o.text.strip()}\n")
            out.flush()

    outputs = engine.generate(prompts, params, raw=args.raw, callback=show)
    st = engine.stats
    reasons = ", ".join(sorted({o.finish_reason for o in outputs}))
    out.write(f"-- {len(outputs)} request(s) ({reasons}) on {engine.device.type}: "
              f"prefill {st.prefill_tokens} tokens, {st.prefill_tps:.1f} tokens/s; "
              f"decode {st.decode_tokens} tokens, {st.decode_tps:.1f} tokens/s"
              f"{f'; {st.preemptions} preemption(s)' if st.preemptions else ''}\n")
    return 0


def _generate(args):
    try:
        return _run_generate(args)
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"lmkernels generate: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # gguf, safetensors or transformers (the [hf] extra)
        print(f"lmkernels generate: error: this model needs the Python package {e.name or e}, which is not "
              f"installed: pip install 'lmkernels[hf]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmkernels generate: interrupted", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lmkernels", description="Triton kernels for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, streamed (default model: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("prompt", nargs="?", help="the prompt (the chat template is applied for instruct models)")
    g.add_argument("--model", default="smollm2",
                   help="a Hugging Face checkpoint directory, a .gguf file, a preset name, or smollm2 (default)")
    g.add_argument("--prompts-file", help="a batch of prompts, one per line")
    g.add_argument("--max-new-tokens", default="256", metavar="N")
    g.add_argument("--temperature", default="0", metavar="T", help="0 (default): greedy")
    g.add_argument("--top-p", default="1", metavar="P")
    g.add_argument("--top-k", default="0", metavar="K", help="0 (default): no limit")
    g.add_argument("--seed", default=None, metavar="S")
    g.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--no-cuda-graph", action="store_true", help="decode without CUDA graphs")
    g.set_defaults(func=_generate)
    sub.add_parser("check", help="run every op against its reference on this device").set_defaults(func=_check)
    b = sub.add_parser("bench", help="benchmark suites on the GPU against peers and measured ceilings")
    b.add_argument("suites", nargs="+", help="suite names (norm, activation, rope, gemv, attention, kda, mla, engine, all, sweep)")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.add_argument("--results-dir", default="benchmarks/results")
    b.add_argument("--markdown", default="BENCHMARKS.md")
    b.set_defaults(func=_bench)
    sub.add_parser("info", help="versions and device").set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
