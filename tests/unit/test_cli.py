"""The command line: `ember generate` streams the same text as the Python API; `ember backends` lists the
built-in backends; bad arguments exit with a clear message."""

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
    out = subprocess.run([sys.executable, "-m", "ember", "backends"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert names == ["cpu_sdpa", "flash", "torch_ref", "triton_unified"]
    assert "cudagraph ALWAYS" in out.stdout and "cudagraph NEVER" in out.stdout


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
