"""The launch command sglang_mxfp8.bench.serving.Server runs: our base flags with the caller's, as SGLang's own argument
parser and its piecewise-graph rule read them."""

import argparse
import shlex

from sglang_mxfp8.bench.serving import BASE_FLAGS, for_this_sglang, launch_flags
from sglang_mxfp8.compat import RENAMED_FLAGS
import pytest

pytestmark = pytest.mark.sglang  # CI runs these again with the newest SGLang


def sglang_reads(argv: list) -> dict:
    """The server args SGLang's parser makes of ``argv``, after its rule that --enforce-piecewise-cuda-graph turns
    --disable-piecewise-cuda-graph off (the rest of its __post_init__ would probe a GPU and the model)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    read = vars(parser.parse_args(["--model-path", "m"] + argv))
    if read.get("enforce_piecewise_cuda_graph"):  # SGLang <= 0.5.17 (0.5.20 dropped the piecewise flags)
        args = object.__new__(ServerArgs)
        args.__dict__.update(read)
        args._handle_piecewise_cuda_graph()
        read = vars(args)
    return read


def sglang_has_flag(flag: str) -> bool:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return any(flag in action.option_strings for action in parser._actions)


def test_caller_flags_replace_the_base_flags_they_repeat_or_turn_off():
    piecewise = sglang_has_flag("--enforce-piecewise-cuda-graph")  # SGLang <= 0.5.17
    graph_bs = "cuda_graph_max_bs" if piecewise else "cuda_graph_max_bs_decode"  # renamed in 0.5.20
    flags = (f"--{graph_bs.replace('_', '-')} 128 {'--enforce-piecewise-cuda-graph ' if piecewise else ''}"
             "--mem-fraction-static=0.5 --fp8-gemm-backend triton")
    argv = launch_flags(BASE_FLAGS, flags)
    kept = ["--skip-tokenizer-init"] if piecewise else ["--disable-piecewise-cuda-graph", "--skip-tokenizer-init",
                                                         "--cuda-graph-max-bs", "16"]
    assert argv == ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                    *kept] + shlex.split(flags)
    assert launch_flags(BASE_FLAGS, "") == shlex.split(BASE_FLAGS)
    read = sglang_reads(for_this_sglang(argv))
    # as both lists one after the other
    assert read == sglang_reads(for_this_sglang(shlex.split(BASE_FLAGS) + shlex.split(flags)))
    assert read[graph_bs] == 128 and read["mem_fraction_static"] == 0.5
    assert not piecewise or (read["enforce_piecewise_cuda_graph"] and not read["disable_piecewise_cuda_graph"])
    assert read["skip_tokenizer_init"] and read["attention_backend"] == "triton"


def test_flags_a_newer_sglang_dropped_become_their_successors():
    known = {"--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", "--port"}
    assert for_this_sglang(["--disable-piecewise-cuda-graph", "--cuda-graph-max-bs=16", "--port", "1"], known) == [
        "--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode=16", "--port", "1"]
    both = known | {"--disable-piecewise-cuda-graph", "--cuda-graph-max-bs"}  # SGLang 0.5.17 parses both
    assert for_this_sglang(["--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", "16"], both) == [
        "--disable-piecewise-cuda-graph", "--cuda-graph-max-bs", "16"]
    assert all(flag in sglang_reads_flags() or successor in sglang_reads_flags()
               for flag, successor in RENAMED_FLAGS.items())  # one of each pair exists in the installed SGLang


def sglang_reads_flags():
    from sglang_mxfp8.bench.serving import sglang_cli_flags

    return sglang_cli_flags()


def test_each_flag_keeps_its_values():
    argv = launch_flags(BASE_FLAGS, "--json-model-override-args '{\"a\": 1}' --grammar-backend xgrammar")
    assert argv[-4:] == ["--json-model-override-args", '{"a": 1}', "--grammar-backend", "xgrammar"]
    assert argv.count("--grammar-backend") == 1 and "none" not in argv
