"""``serve``: the official ``openai`` client against a real local port gets exactly ``generate``'s answers, whole and
streamed; bad requests are OpenAI-style errors and the server keeps serving; it binds beyond this machine only when told."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.generate import load_generator
from {{ cookiecutter.package_name }}.serve import served_app

from .conftest import EOS, byte_level_bpe, common_overrides, compose_config, lm_documents, tiny_llama_config
from .processes import run_module
from .test_chat_data import CHATML, END, START

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

STOPS, RUNS_ON = "the king", "the queen speaks"  # this model's answer to the first ends early, to the second not
MAX_TOKENS = 12


def exported_folder(folder: Path, chat_template: str | None = CHATML) -> Path:
    """A folder as export writes it for a chat run: a tiny random Llama, a ChatML tokenizer and ``chat.json``.  Its end-of-turn
    row of the output layer is doubled: some answers end before ``MAX_TOKENS``, others run to it."""
    texts = lm_documents(200, seed=0) + ["user assistant system"] * 20
    tokenizer = byte_level_bpe(texts, [EOS, START, END], eos_token=END, bos_token=START)
    tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), hidden_size=32, intermediate_size=64), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(END)] *= 2
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat.json").write_text(json.dumps({"end_of_turn": END, "system_prompt": None}), encoding="utf-8")
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_config(tmp_path: Path, *overrides: str):
    return compose_config("serve", [*common_overrides(tmp_path / "run"), *overrides])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``serve model_dir=<tiny folder>`` on a free port (uvicorn in a thread); yields its URL, id and the same model loaded
    again (what ``generate`` answers with)."""
    tmp_path = tmp_path_factory.mktemp("serve")
    folder = exported_folder(tmp_path / "tiny-chat-lm")
    port = free_port()
    cfg = serve_config(tmp_path, f"model_dir={folder}", f"port={port}")
    app, name = served_app(cfg)
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/v1"
    module = load_generator(cfg).to("cuda" if torch.cuda.is_available() else "cpu")  # (where serve put its copy: the same numbers)
    yield SimpleNamespace(url=url, name=name, module=module, client=openai.OpenAI(base_url=url, api_key="none", max_retries=0))
    running.should_exit = True
    thread.join(timeout=30)


def ask(server, prompt: str, **options):
    return server.client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": prompt}], **options)


def text_of(answer) -> str:
    """A whole answer's text, or a stream's pieces joined."""
    if hasattr(answer, "choices"):
        return answer.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)


def test_answers_are_generates_whole_and_streamed(server):
    models = server.client.models.list()
    assert [model.id for model in models.data] == [server.name] == ["tiny-chat-lm"]  # (model_name=null: the folder's name)
    module, reasons = server.module, set()
    for prompt in (STOPS, RUNS_ON):
        expected = module.generate_text([prompt], max_new_tokens=MAX_TOKENS)[0]  # what `generate` prints and writes
        new = module.complete(module.prompt_ids([prompt]), max_new_tokens=MAX_TOKENS)[0]
        reason = "length" if len(new) == MAX_TOKENS else "stop"
        usage = {"prompt_tokens": len(module.prompt_ids([prompt])[0]), "completion_tokens": len(new)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

        answer = ask(server, prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert answer.object == "chat.completion" and answer.model == server.name
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content == expected
        assert answer.choices[0].finish_reason == reason
        assert answer.usage.model_dump(include=set(usage)) == usage

        chunks = list(ask(server, prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason] == [reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include=set(usage)) == usage
        streamed = ask(server, prompt, max_completion_tokens=MAX_TOKENS, stream=True)  # (no usage chunk unless asked)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected
        reasons.add(reason)
    assert reasons == {"stop", "length"}  # both endings were checked
    with ThreadPoolExecutor(2) as pool:  # at once: answered one after the other, each as alone
        answers = list(pool.map(lambda stream: text_of(ask(server, RUNS_ON, max_tokens=MAX_TOKENS, stream=stream)), [True, False]))
    assert answers == [module.generate_text([RUNS_ON], max_new_tokens=MAX_TOKENS)[0]] * 2
    # temperature > 0 samples; a seed makes it repeatable
    sampled = [ask(server, RUNS_ON, max_tokens=MAX_TOKENS, temperature=1.5, seed=3).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(server):
    def still_serving():
        assert ask(server, RUNS_ON, max_tokens=2).choices[0].message.content is not None

    with pytest.raises(openai.NotFoundError) as unknown:
        server.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert unknown.value.status_code == 404 and server.name in unknown.value.message
    assert unknown.value.body["param"] == "model" and unknown.value.body["code"] == "model_not_found"
    still_serving()

    with pytest.raises(openai.BadRequestError) as too_long:
        ask(server, RUNS_ON, max_tokens=200)
    prompt_tokens = len(server.module.prompt_ids([RUNS_ON])[0])
    message = too_long.value.message
    assert "128 tokens" in message and f"{prompt_tokens} tokens" in message and "max_tokens is 200" in message
    assert f"max_tokens <= {128 - prompt_tokens}" in message
    still_serving()

    for messages, words in [([], "messages is empty"), ([{"role": "assistant", "content": "hi"}], "end messages with a user message")]:
        with pytest.raises(openai.BadRequestError, match=words):
            server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stop=.*this server does not support it.*fix: leave stop out"):
        ask(server, RUNS_ON, max_tokens=2, stop=["\n"])
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: Input should be a valid integer"):
        ask(server, RUNS_ON, max_tokens="2")
    still_serving()

    url = f"{server.url}/chat/completions"
    for body, words in [
        (b'{"model": "x", "messages": [', "not valid JSON"),
        (b"\xff\xfe not json", "not valid JSON"),
        (b"[1]", "not an object"),
    ]:
        response = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and words in response.json()["error"]["message"]
    response = httpx.post(url, json={"model": server.name, "messages": [{"role": "user", "content": 3}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.content.str"
    response = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"]["message"] == "invalid request: model: Field required"
    body = json.dumps({"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert httpx.post(url, content=body, headers={"Content-Type": "application/x-www-form-urlencoded"}).status_code == 200  # (curl -d)
    assert httpx.get(f"{server.url}/completions").status_code == 404  # (no such route: still an OpenAI error body)
    still_serving()
    with ask(server, RUNS_ON, max_tokens=100, stream=True) as stream:  # a client that stops reading: generation ends
        next(iter(stream))
    still_serving()


def test_binding_beyond_this_machine_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    from {{ cookiecutter.package_name }} import serve

    monkeypatch.setattr(serve, "load_generator", lambda cfg: pytest.fail("weights were loaded"))
    missing = tmp_path / "missing.ckpt"  # (read after the bind rule: never reached)
    with pytest.raises(ConfigError, match=r"host='0\.0\.0\.0' would serve the model beyond this machine.*allow_remote=true") as refused:
        served_app(serve_config(tmp_path, "host=0.0.0.0", f"ckpt_path={missing}"))
    assert "missing.ckpt" not in str(refused.value)
    with pytest.raises(ConfigError, match="missing.ckpt"):  # told: the bind rule passes, and the checkpoint is checked next
        served_app(serve_config(tmp_path, "host=0.0.0.0", "allow_remote=true", f"ckpt_path={missing}"))
    for host in ("localhost", "127.0.0.2", "::1"):
        with pytest.raises(ConfigError, match="missing.ckpt"):
            served_app(serve_config(tmp_path, f"host='{host}'", f"ckpt_path={missing}"))
    with pytest.raises(ConfigError, match=r"generation.temperature is not a server setting"):
        served_app(serve_config(tmp_path, "+generation.temperature=0.7", f"ckpt_path={missing}"))
    process = run_module("serve", ["host=0.0.0.0", f"ckpt_path={missing}", f"paths.output_dir={tmp_path / 'run'}"], timeout=120)
    assert process.returncode == 1 and "allow_remote=true" in process.stderr and "Traceback" not in process.stderr


def test_a_model_without_a_chat_template_is_refused_naming_generate(tmp_path):
    folder = exported_folder(tmp_path / "plain-lm", chat_template=None)
    (folder / "chat.json").unlink()
    with pytest.raises(ConfigError, match=r"no chat template.*generate"):
        served_app(serve_config(tmp_path, f"model_dir={folder}", f"port={free_port()}"))
