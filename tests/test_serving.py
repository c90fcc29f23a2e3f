"""The launch command sglang_mxfp8.cli.serving.Server runs: our base flags with the caller's, as SGLang's own argument
parser and its piecewise-graph rule read them."""

import argparse
import shlex

from sglang_mxfp8.cli.serving import BASE_FLAGS, launch_flags


def sglang_reads(argv: list) -> dict:
    """The server args SGLang's parser makes of ``argv``, after its rule that --enforce-piecewise-cuda-graph turns
    --disable-piecewise-cuda-graph off (the rest of its __post_init__ would probe a GPU and the model)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = object.__new__(ServerArgs)
    args.__dict__.update(vars(parser.parse_args(["--model-path", "m"] + argv)))
    if args.enforce_piecewise_cuda_graph:
        args._handle_piecewise_cuda_graph()
    return vars(args)


def test_caller_flags_replace_the_base_flags_they_repeat_or_turn_off():
    flags = "--cuda-graph-max-bs 128 --enforce-piecewise-cuda-graph --mem-fraction-static=0.5 --fp8-gemm-backend triton"
    argv = launch_flags(BASE_FLAGS, flags)
    assert argv == ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                    "--skip-tokenizer-init"] + shlex.split(flags)
    assert launch_flags(BASE_FLAGS, "") == shlex.split(BASE_FLAGS)
    read = sglang_reads(argv)
    assert read == sglang_reads(shlex.split(BASE_FLAGS) + shlex.split(flags))  # as both lists one after the other
    assert read["cuda_graph_max_bs"] == 128 and read["mem_fraction_static"] == 0.5
    assert read["enforce_piecewise_cuda_graph"] and not read["disable_piecewise_cuda_graph"]
    assert read["skip_tokenizer_init"] and read["attention_backend"] == "triton"


def test_each_flag_keeps_its_values():
    argv = launch_flags(BASE_FLAGS, "--json-model-override-args '{\"a\": 1}' --grammar-backend xgrammar")
    assert argv[-4:] == ["--json-model-override-args", '{"a": 1}', "--grammar-backend", "xgrammar"]
    assert argv.count("--grammar-backend") == 1 and "none" not in argv
