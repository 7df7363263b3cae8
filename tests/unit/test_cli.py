"""The command line: `ember generate` streams the same text as the Python API; `ember backends` lists the
built-in backends; bad arguments exit with a clear message."""

import os
import subprocess
import sys

import pytest

from ember import LLM, SamplingParams
from ember.cli import main


def test_generate_streams_the_api_text(converted, capsys):
    folder = str(converted["folder"])
    code = main(["generate", "--model", folder, "--device", "cpu", "--prompt", "The capital of France is",
                 "--max-tokens", "12", "--ignore-eos"])
    assert code == 0
    printed = capsys.readouterr().out
    llm = LLM(folder, device="cpu")
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert expected and printed == expected + "\n"


def test_bad_argument_is_reported(converted, capsys):
    code = main(["generate", "--model", str(converted["folder"]), "--device", "cpu", "--prompt", "x",
                 "--top-p", "1.5"])
    assert code == 2
    assert "top_p 1.5 must be in (0, 1]" in capsys.readouterr().err


def test_backends_via_python_m():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "ember", "backends", "--device", "cpu"], capture_output=True,
                         text=True, check=True, env=env)
    listing, choice = out.stdout.split("\n\n")
    names = [line.split()[0] for line in listing.splitlines()]
    assert names == ["cpu_sdpa", "flash", "per_phase", "torch_ref", "triton_unified"]
    assert "cudagraph ALWAYS" in listing and "cudagraph NEVER" in listing
    # what auto picks here and why the others were passed over (the CPU without the interpreter)
    assert choice.startswith("auto on cpu, float32, 16-token pages, 32/8 heads of 128: cpu_sdpa"), choice
    assert "passed over per_phase: on a CPU the Triton kernels run only under TRITON_INTERPRET=1; block_size 16" \
        in choice


def test_backends_says_why_per_phase_is_picked(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["backends", "--device", "cpu", "--block-size", "64"]) == 0
    choice = capsys.readouterr().out.split("\n\n")[1]
    assert choice.startswith("auto on cpu, float32, 64-token pages, 32/8 heads of 128: per_phase: priority 30, "
                             "cudagraph ALWAYS; prefill through flash, decode through triton_unified"), choice


def test_input_errors_come_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    monkeypatch.setattr("ember.models.default_model.ensure_default_model",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model fetched")))
    assert main(["generate", "--device", "cpu", "--prompt", ""]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--device", "cpu", "--prompt", "hi", "--attention-backend", "nope"]) == 2
    assert "attention backend 'nope' is not registered" in capsys.readouterr().err


def test_ctrl_c_ends_with_one_line_and_exit_130(monkeypatch, capsys):
    class Interrupted:
        def __init__(self, *args, **kwargs):
            pass

        def generate_stream(self, prompt, params):
            raise KeyboardInterrupt

    monkeypatch.setattr("ember.llm.LLM", Interrupted)
    assert main(["generate", "--device", "cpu", "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert err == "ember: interrupted\n"


def test_attention_backend_options_from_the_command_line(monkeypatch, capsys):
    import argparse
    from ember.args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--attention-backend-option", "fused_decode_kv_write=off",
                              "--attention-backend-option", "split_launch=True", "--attention-backend-option", "x=2",
                              "--attention-backend-option", "single_segment_tiles=0"])
    options = engine_kwargs(args)["attention_backend_options"]
    assert options == {"fused_decode_kv_write": False, "split_launch": True, "x": 2, "single_segment_tiles": 0}
    assert type(options["single_segment_tiles"]) is int    # a count of 0 is not the flag False
    assert engine_kwargs(parser.parse_args([]))["attention_backend_options"] is None
    monkeypatch.setattr("ember.llm.Engine", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    monkeypatch.setattr("ember.models.default_model.ensure_default_model",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model fetched")))
    with pytest.raises(SystemExit) as exit_info:   # argparse's own error exit
        main(["generate", "--device", "cpu", "--prompt", "hi", "--attention-backend-option", "split_launch"])
    assert exit_info.value.code == 2
    assert "'split_launch' is not NAME=VALUE" in capsys.readouterr().err
    assert main(["generate", "--device", "cpu", "--prompt", "hi", "--attention-backend-option",
                 "fused_decode_kv_wirte=off"]) == 2
    assert "['fused_decode_kv_wirte'] are not read by backend 'auto'" in capsys.readouterr().err


def test_version(capsys):
    import ember
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"ember {ember.__version__}\n" == "ember 0.1.0\n"


class _Recorder:
    """An LLM that records its model and generates nothing."""
    models = []

    def __init__(self, model, **kwargs):
        _Recorder.models.append(model)

    def generate_stream(self, prompt, params):
        return iter(())


def test_generate_takes_the_model_as_serve_does(monkeypatch, capsys):
    monkeypatch.setattr("ember.llm.LLM", _Recorder)
    _Recorder.models = []
    assert main(["generate", "some/model", "--device", "cpu", "--prompt", "hi"]) == 0
    assert main(["generate", "--model", "other/model", "--device", "cpu", "--prompt", "hi"]) == 0
    assert main(["generate", "same/model", "--model", "same/model", "--device", "cpu", "--prompt", "hi"]) == 0
    assert _Recorder.models == ["some/model", "other/model", "same/model"]
    capsys.readouterr()
    assert main(["generate", "a/model", "--model", "b/model", "--device", "cpu", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "error: give the model once: 'a/model' or --model 'b/model'\n"
    assert _Recorder.models == ["some/model", "other/model", "same/model"]


def _busy_port():
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


def test_serve_on_a_busy_port_fails_before_the_model_loads(monkeypatch, capsys):
    """`ember serve` binds its address first: on a busy port it exits 2 (`python -m ember` and the `ember` script
    exit with main's value) with the reason, and prints no address it does not serve."""
    monkeypatch.setattr("ember.llm.LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    listener, port = _busy_port()
    with listener:
        assert main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"error: port {port} on 127.0.0.1 is already in use; stop the process that listens there or pass "
                   f"another --port\n")


@pytest.mark.parametrize("command, flags", [
    (["bench", "latency"], {"--batch-size BATCH_SIZE": "1", "--input-len INPUT_LEN": "32",
                            "--output-len OUTPUT_LEN": "256", "--num-iters NUM_ITERS": "5"}),
    (["bench", "throughput"], {"--num-prompts NUM_PROMPTS": "256", "--input-len INPUT_LEN": "100:1024",
                               "--output-len OUTPUT_LEN": "100:1024", "--max-num-seqs MAX_NUM_SEQS": "256"}),
])
def test_bench_help_shows_the_defaults(command, flags, capsys):
    import re
    with pytest.raises(SystemExit) as info:
        main(command + ["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    entries = re.split(r" (?=--[a-z])", text)       # "--flag METAVAR help (default: X)", one per flag
    for flag, default in flags.items():
        [entry] = [e for e in entries if e.startswith(flag + " ")]
        assert entry.endswith(f"(default: {default})"), entry
