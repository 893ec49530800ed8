"""The chat verb: a conversation on a real terminal (streamed greedy answers, /reset, Ctrl-C stopping an answer), the
history kept within its token budget, and a model without a chat template refused before the first prompt."""

from __future__ import annotations

import codecs
import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.chat import TurnTooLong, chat, fit_history, history_budget
from {{ cookiecutter.package_name }}.core.errors import ConfigError
from {{ cookiecutter.package_name }}.generate import load_generator

from .conftest import EOS, byte_level_bpe, compose_config, lm_documents, tiny_llama_config
from .processes import subprocess_env
from .test_chat_data import CHATML, END, MULTI_TURN, START, chat_overrides, chat_rows, write_jsonl

LONG = 400  # new tokens of each answer on the terminal (the model never ends one early: see chat_base)
# (Each wait allows minutes: under CI's second test process the terminal's process, one thread, starts and answers slowly.)


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory) -> Path:
    """A tiny Llama (1024 positions) with the ChatML tokenizer and template, whose end-of-turn logit is always 0: greedy
    answers (random logits, some above 0) never end before ``max_new_tokens``.  So are the logits of every token that is
    not printable ASCII text (control bytes, pieces of UTF-8 characters): a terminal shows its answers as they are, on
    any CPU (random weights pick other tokens on other CPUs)."""
    folder = tmp_path_factory.mktemp("chat_base")
    texts = lm_documents(200, seed=0) + ["user assistant system"] * 20
    tokenizer = byte_level_bpe(texts, [EOS, START, END], eos_token=END, bos_token=START)
    tokenizer.chat_template = CHATML
    config = tiny_llama_config(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # (LoRA leaves lm_head as it is)
        for token in range(len(tokenizer)):
            text = tokenizer.decode([token])
            if token in tokenizer.all_special_ids or not all(c == "\n" or (c.isascii() and c.isprintable()) for c in text):
                model.lm_head.weight[token] = 0.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_ckpt(chat_base, tmp_path_factory) -> Path:
    """A 4-step LoRA run on chat rows from :func:`chat_base` (data.max_length=64); its last.ckpt."""
    from {{ cookiecutter.package_name }}.train import train

    folder = tmp_path_factory.mktemp("chat_run")
    data = {
        "train": write_jsonl(folder / "train.jsonl", chat_rows(30, seed=3) + [MULTI_TURN] * 2),
        "validation": write_jsonl(folder / "validation.jsonl", chat_rows(4, seed=4)),
    }
    overrides = chat_overrides(chat_base, data, chat_base, folder / "run")
    train(compose_config("train", [*overrides, "callbacks.sample_generation=null", "test_after_fit=false"]))
    return folder / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def module(chat_ckpt):
    return load_generator(compose_config("chat", [f"ckpt_path={chat_ckpt}"]))


def scripted(lines: list[str]):
    """A ``read_line`` for :func:`chat` that returns ``lines`` in turn, then ends the session (EOF)."""
    pending = iter(lines)

    def read_line(prompt: str) -> str:
        line = next(pending, None)
        if line is None:
            raise EOFError
        return line

    return read_line


class Terminal:
    """A process on a pseudo-terminal (its stdin, stdout and stderr) in its own process group, and what it wrote so far
    (CR LF as LF, escape sequences dropped).  :meth:`interrupt` is what Ctrl-C on a terminal does: SIGINT to the
    foreground process group (no ``preexec_fn`` makes the pty the controlling terminal: Python code in a child forked from
    a process with threads may deadlock before ``exec``).  The process starts with SIGINT ignored, as a shell's background
    job does (CI's test processes did, and chat's Ctrl-C did nothing there): chat must stop an answer all the same."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        self.leader, follower = os.openpty()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # (inherited through exec, unlike a Python handler)
        try:
            self.process = subprocess.Popen(
                command, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=cwd, start_new_session=True
            )
        finally:
            signal.signal(signal.SIGINT, handler)
        os.close(follower)
        self.output = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # (a read may end inside a character)

    def read(self, until, timeout: float = 300.0) -> None:
        """Read until ``until(output)`` holds."""
        deadline = time.monotonic() + timeout
        while not until(self.output):
            assert time.monotonic() < deadline, f"waited {timeout} s; the terminal shows:\n{self.output}"
            ready, _, _ = select.select([self.leader], [], [], 0.5)
            if ready:
                try:
                    data = os.read(self.leader, 65536)
                except OSError:  # the process closed the terminal
                    data = b""
                assert data, f"the process ended; the terminal shows:\n{self.output}"
                text = self.output + self.decoder.decode(data)
                self.output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r\n", "\n")

    def expect(self, marker: str, after: int = 0, timeout: float = 300.0) -> int:
        """Read until ``marker`` appears at or after ``after`` in :attr:`output`; where it ends."""
        self.read(lambda output: marker in output[after:], timeout)
        return self.output.index(marker, after) + len(marker)

    def send(self, text: str) -> int:
        """Type ``text``; where the output stood."""
        start = len(self.output)
        os.write(self.leader, text.encode())
        return start

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the process group; where the output stood."""
        start = len(self.output)
        os.killpg(self.process.pid, signal.SIGINT)
        return start

    def close(self) -> int:
        os.close(self.leader)
        return self.process.wait(timeout=30)


def test_a_terminal_conversation_streams_greedy_answers_and_ctrl_c_stops_one(module, chat_ckpt, tmp_path):
    """The answer printed is generate's greedy answer; Ctrl-C (SIGINT) during an answer prints (stopped), keeps that turn out of
    the history and the session goes on; /exit ends it with 0."""
    first, stopped, later = "the king speaks", "the queen", "and the ghost"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the terminal's process computes (the same sums); and on 2 cores far faster
    try:
        expected = {prompt: module.generate_text([prompt], max_new_tokens=LONG)[0] for prompt in (first, stopped, later)}
    finally:
        torch.set_num_threads(threads)
    source = Path({{ cookiecutter.package_name }}.__file__).resolve().parents[1]
    env = subprocess_env()
    env.update(PYTHONPATH=os.pathsep.join([str(source), env["PYTHONPATH"]]), TERM="dumb", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.chat", f"ckpt_path={chat_ckpt}"]
    command += [f"generation.max_new_tokens={LONG}", f"max_length={LONG + 100}", f"hydra.run.dir={tmp_path / 'chat'}"]
    terminal = Terminal(command, env, cwd=tmp_path)
    try:
        terminal.expect("\n> ", after=terminal.expect("Ctrl-C stops an answer"))
        terminal.expect(f"{first}\n{expected[first]}\n> ", after=terminal.send(first + "\n"))
        terminal.expect("(history cleared)\n> ", after=terminal.send("/reset\n"))
        answering = terminal.expect(f"{stopped}\n", after=terminal.send(f"{stopped}\n"))
        terminal.read(lambda output: len(output) > answering)  # the first piece of the answer is out
        at = terminal.expect("\n(stopped)\n> ", after=terminal.interrupt())
        partial = terminal.output[answering:at].removesuffix("\n(stopped)\n> ")
        assert partial and expected[stopped].startswith(partial) and len(partial) < len(expected[stopped])
        # The stopped turn is not in the history: the next answer is the one to a first turn.
        terminal.expect(f"{later}\n{expected[later]}\n> ", after=terminal.send(later + "\n"))
        terminal.send("/exit\n")
        assert terminal.process.wait(timeout=30) == 0
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()
        terminal.close()


def test_the_oldest_turns_are_dropped_to_fit_the_budget_with_one_note(module, chat_ckpt):
    history = [
        {"role": "user", "content": "the king speaks"},
        {"role": "assistant", "content": "to a fool"},
        {"role": "user", "content": "and the queen"},
        {"role": "assistant", "content": "love night"},
        {"role": "user", "content": "the ghost"},
    ]
    assert fit_history(module, history, 10_000) == (history, False)
    last_pair = len(module.messages_ids(history[2:]))
    assert fit_history(module, history, last_pair) == (history[2:], True)
    assert fit_history(module, history, last_pair - 1) == (history[4:], True)
    with pytest.raises(TurnTooLong):
        fit_history(module, history, len(module.messages_ids(history[4:])) - 1)

    out = io.StringIO()
    cfg = compose_config("chat", [f"ckpt_path={chat_ckpt}", "max_length=40", "generation.max_new_tokens=4"])
    assert history_budget(cfg, module) == 40  # (the answer's 4 tokens fit the model's 1024 positions beyond it)
    lines = ["the king speaks", "and the queen", "the ghost", "a sword", " ".join(["the king"] * 40), "love night"]
    kept = chat(cfg, read_line=scripted(lines), out=out)
    text = out.getvalue()
    assert text.count("(older turns dropped to keep the conversation within 40 tokens)") == 1
    assert "(that message takes" in text  # the long one is skipped, the session goes on
    users = [turn["content"] for turn in kept if turn["role"] == "user"]
    assert users[-1] == "love night" and "the king speaks" not in users and "and the queen" not in users  # (two drops)
    assert len(module.messages_ids(kept[:-1])) <= 40
    with pytest.raises(ConfigError, match="no room for a prompt"):
        history_budget(compose_config("chat", [f"ckpt_path={chat_ckpt}", "generation.max_new_tokens=1024"]), module)


def test_a_model_without_a_chat_template_is_refused_before_the_first_prompt(pretrained_lm_dir):
    def never(prompt: str) -> str:
        raise AssertionError("the conversation started")

    with pytest.raises(ConfigError, match=r"no chat template .*fix: complete text with generate"):
        chat(compose_config("chat", [f"model_dir={pretrained_lm_dir}"]), read_line=never)


def test_a_base_models_template_is_used_with_a_note(chat_base):
    """A folder without chat.json whose tokenizer has a template (a text model from a chat base) still chats."""
    out = io.StringIO()
    kept = chat(compose_config("chat", [f"model_dir={chat_base}", "generation.max_new_tokens=4"]), read_line=scripted(["hello"]), out=out)
    assert "the base model's" in out.getvalue().splitlines()[0]
    assert [turn["role"] for turn in kept] == ["user", "assistant"] and kept[1]["content"]
    assert AutoTokenizer.from_pretrained(chat_base).chat_template is not None
