"""Chat / instruction data for causal LMs: render with the chat template, train on the answers.

Rows (:func:`conversation`; ``data.columns`` renames fields): ``messages`` (``{role, content}`` turns), ShareGPT
``conversations``, Alpaca ``instruction``/``input``/``output`` or ``prompt``/``completion``.  Each is rendered with the chat
template (the tokenizer's, or ``chat_template``) and tokenised once (cached by ``datasets``); a turn spelling a special token is
refused.  ``train_on`` (labels -100 elsewhere): ``assistant`` (each answer and the end-of-turn token closing it, so the model
learns to stop), ``last_assistant``, ``completion`` (prompt/completion rows) or ``all``; the spans come from ``{% generation %}``
markers, else from rendering prefix by prefix (:func:`assistant_token_mask`).  ``truncation``: ``right`` keeps the first
``max_length`` tokens, ``left`` the last; a row left with no trained token is dropped and counted.  ``mode``: ``pad`` (a row per
sequence) or ``pack_rows`` (whole rows in ``max_length`` blocks, best fit, ``position_ids`` from 0 per row, no attention mask:
transformers builds a block-diagonal causal mask, dense ``(B, 1, T, T)`` for SDPA/eager, varlen for flash_attention_2).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections import Counter
from pathlib import Path

import datasets
import jinja2
import torch
from transformers import PreTrainedTokenizerBase

from ...core.data.batching import TokenizedDataModule
from ...core.data.loading import load_split
from ...core.data.tokenization import cut_for_tokens, load_tokenizer, piece_chars, tail_for_tokens
from ...core.errors import ConfigError, DataError, TemplateError
from .text import IGNORE_INDEX, pad_token_id

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
CHAT_MODES = ("pad", "pack_rows")  # data.mode: one row per sequence, or rows packed (position ids restart per row)
TRAIN_ON = ("assistant", "last_assistant", "completion", "all")  # data.train_on: the tokens with a loss
TRUNCATION = ("right", "left")  # data.truncation: which end of a row longer than max_length is cut
# ShareGPT's speakers (and our own role names) -> roles; data.roles replaces it for other names.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# The fields of every row format conversation() reads (data.columns maps them to a file's names).
ROW_FIELDS = ("messages", "conversations", "instruction", "input", "output", "system", "prompt", "completion")
# Named templates shipped with the project (data.chat_template=<name>), for tokenizers without one.
TEMPLATES_DIR = Path(__file__).resolve().parent / "chat_templates"
GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
# In the tokenised cache's key (datasets hashes the map function, not what it calls): a new labelling rule, a new cache.
LABEL_RULE = "pieces-at-answer-boundaries-3"


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """The Jinja template: the tokenizer's own (``None``), a shipped one by name (``chat_templates/<name>.jinja``) or a ``.jinja`` file.

    Raises:
        ConfigError: no template at all, or an unknown name / missing file.
    """
    if chat_template is None:
        if not isinstance(tokenizer.chat_template, str) or not tokenizer.chat_template:
            shipped = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
            raise ConfigError(
                f"model.tokenizer ({tokenizer.name_or_path!r}) has no chat template, so data=chat cannot render its rows; "
                f"fix: data.chat_template=<name> (shipped: {', '.join(shipped)}) or data.chat_template=path/to/template.jinja"
            )
        return tokenizer.chat_template
    shipped = TEMPLATES_DIR / f"{chat_template}.jinja"
    if shipped.is_file():
        return shipped.read_text(encoding="utf-8")
    if chat_template.endswith(".jinja"):
        if not os.path.isfile(chat_template):
            raise ConfigError(f"data.chat_template={chat_template!r} does not exist; fix: the path of a .jinja file, or a shipped name")
        return Path(chat_template).read_text(encoding="utf-8")
    names = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
    raise ConfigError(
        f"data.chat_template={chat_template!r} is neither a shipped template ({', '.join(names)}) nor a .jinja file; "
        "fix: one of those names, a path to a .jinja file, or null (the tokenizer's own)"
    )


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase, end_of_turn: str | None) -> int:
    """The id of the token closing an assistant turn: ``end_of_turn``, else the EOS (``<|im_end|>``, Llama 3's ``<|eot_id|>``).

    Raises:
        ConfigError: the token is not a single token of the vocabulary.
    """
    token = end_of_turn if end_of_turn is not None else tokenizer.eos_token
    token_id = tokenizer.convert_tokens_to_ids(token) if token is not None else None
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ConfigError(
            f"data.end_of_turn={token!r} is not one token of model.tokenizer ({tokenizer.name_or_path!r}); "
            "fix: the special token the chat template closes assistant turns with (e.g. <|im_end|>, <|eot_id|>)"
        )
    return token_id


def conversation(
    row: dict, system_prompt: str | None, where: str, columns: dict[str, str] | None = None, roles: dict[str, str] | None = None
) -> tuple[list[dict], bool]:
    """The row as chat messages, and whether it was a one-turn (prompt/completion or Alpaca) row.

    Formats, first match wins: ``messages`` (roles :data:`ROLES`), ShareGPT ``conversations`` (``from`` mapped by ``roles``),
    ``prompt``/``completion``, Alpaca (the user turn: the instruction, a newline and the input if any, as LLaMA-Factory and axolotl
    read it).  ``columns`` maps these names to the file's; ``system_prompt`` (not ``None``) sets or replaces the system turn.

    Raises:
        DataError: no format matches, a field of it is missing or not text, or a turn has no known role.
    """
    columns = columns or {}
    row = {name: row.get(columns.get(name, name)) for name in ROW_FIELDS}
    named = lambda name: name if columns.get(name, name) == name else f"{name} (column {columns[name]!r})"
    completion_row = False
    if row["messages"] is not None:
        messages = row["messages"]
        if isinstance(messages, str):
            raise DataError(
                f"{where}: {named('messages')} is text ({messages!r:.60}), not a list of {{role, content}} turns (a csv cell holds "
                "text only); fix: jsonl or parquet rows, or prompt/completion columns"
            )
        if not isinstance(messages, list) or not messages:
            raise DataError(
                f"{where}: {named('messages')} must be a non-empty list of {{role, content}}; got {messages!r:.80}; fix: the row's messages"
            )
        for turn in messages:
            if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
                raise DataError(f"{where}: each turn needs a role in {ROLES} and text content; got {turn!r:.80}; fix: the row's messages")
        messages = [{"role": turn["role"], "content": turn["content"]} for turn in messages]
    elif row["conversations"] is not None:
        messages = sharegpt_messages(row["conversations"], roles or SHAREGPT_ROLES, f"{where}: {named('conversations')}")
    elif isinstance(row["prompt"], str) and isinstance(row["completion"], str):
        messages, completion_row = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}], True
    elif row["instruction"] is not None or row["output"] is not None:
        for field in ("instruction", "output"):
            if not isinstance(row[field], str):
                raise DataError(
                    f"{where}: an Alpaca row needs {named(field)} as text; got {row[field]!r:.60}; fix: the row's {field} "
                    "(or data.columns mapping it to the file's column)"
                )
        for field in ("input", "system"):
            if row[field] is not None and not isinstance(row[field], str):
                raise DataError(f"{where}: {named(field)} must be text or absent; got {row[field]!r:.60}; fix: the row's {field}")
        prompt = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
        if row["system"]:
            messages.insert(0, {"role": "system", "content": row["system"]})
        completion_row = True
    else:
        present = sorted(name for name, value in row.items() if value is not None)
        raise DataError(
            f"{where} matches no row format (fields found: {present}); fix: rows with messages [{{role, content}}], "
            "conversations [{from, value}] (ShareGPT), instruction/input/output (Alpaca) or prompt/completion, "
            "or data.columns mapping those names to your columns"
        )
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [turn for turn in messages if turn["role"] != "system"]
    return messages, completion_row


def sharegpt_messages(turns: object, roles: dict[str, str], where: str) -> list[dict]:
    """ShareGPT turns (``{from, value}``, or ``{role, content}``) as messages, ``from`` mapped by ``roles``.

    Raises:
        DataError: not a non-empty list of turns, a ``from`` missing from ``roles``, a non-text ``value``.
    """
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where} must be a non-empty list of {{from, value}} turns; got {turns!r:.80}; fix: the row's conversations")
    messages = []
    for number, turn in enumerate(turns):
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        value = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if speaker not in roles:
            raise DataError(
                f"{where} turn {number}: from={speaker!r} is not one of data.roles {sorted(roles)}; fix: data.roles "
                f"mapping it to one of {ROLES}, e.g. data.roles.{speaker}=user"
            )
        if not isinstance(value, str):
            raise DataError(f"{where} turn {number}: value must be text; got {value!r:.60}; fix: the row's conversations")
        messages.append({"role": roles[speaker], "content": value})
    return messages


def render(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict], generation_prompt: bool = False) -> str:
    """The conversation as the template writes it (text, special tokens as text)."""
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_token_mask(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: list[dict],
    turns: list[int],
    generation_prompt: bool = False,
    keep: tuple[int, str] | None = None,
) -> tuple[list[int], list[int], bool]:
    """Token ids of the conversation and, per token, its assistant turn (index in ``messages``, if in ``turns``) or -1; and
    whether only part of it was tokenised: ``keep=(max_length, side)`` tokenises, of a rendering over
    :func:`...core.data.tokenization.piece_chars`, only the pieces holding its first (``right``) or last (``left``)
    ``max_length + 2`` tokens (:func:`bounded`), as plain text is.

    Turn ``i`` starts where ``messages[:i]`` with the generation prompt ends, the text ``generate`` tokenises before the answer;
    the text is tokenised in pieces cut there, so training and inference agree on the answer's first token (tokenised whole,
    ``Assistant: `` would merge its space into it).  ``generation_prompt``: end with the generation prompt (:func:`chat_prompt_ids`).

    Raises:
        TemplateError: a prefix of the conversation does not render as a prefix of the whole.
    """
    whole = render(tokenizer, template, messages, generation_prompt=generation_prompt)
    pieces, position = [], 0  # (text, owner)
    for turn in [index for index, message in enumerate(messages) if message["role"] == "assistant"]:
        prompt = render(tokenizer, template, messages[:turn], generation_prompt=True) if turn else ""
        with_answer = render(tokenizer, template, messages[: turn + 1])
        if not (whole.startswith(with_answer) and with_answer.startswith(prompt)) or len(prompt) < position:
            raise TemplateError(
                f"the chat template does not render the conversation up to turn {turn} as a prefix of the whole "
                "conversation, so the answer's tokens cannot be told from the rendering; fix: a template with "
                "{% generation %} markers around assistant content (data.chat_template=...), or data.train_on=all"
            )
        pieces += [(whole[position : len(prompt)], -1), (whole[len(prompt) : len(with_answer)], turn if turn in turns else -1)]
        position = len(with_answer)
    pieces.append((whole[position:], -1))
    long = keep is not None and len(whole) > piece_chars(keep[0])
    if long:
        tokenised = bounded(pieces, tokenizer, keep)
    else:
        tokenised = [(tokenizer(text, add_special_tokens=False)["input_ids"], turn) for text, turn in pieces if text]
    ids = [token for piece_ids, _ in tokenised for token in piece_ids]
    owner = [turn for piece_ids, turn in tokenised for _ in piece_ids]
    return ids, owner, long


def bounded(pieces: list[tuple[str, int]], tokenizer: PreTrainedTokenizerBase, keep: tuple[int, str]) -> list[tuple[list[int], int]]:
    """The ids of a long rendering's ``(text, owner)`` pieces, as far as they hold its first (``keep[1] == "right"``) or last
    ``keep[0] + 2`` tokens, each piece cut by :func:`...cut_for_tokens` / :func:`...tail_for_tokens`: the ids the
    truncation keeps are those of the whole, and no tokenizer call gets more than about ``2 x piece_chars`` characters."""
    max_length, side = keep
    size, budget, kept = piece_chars(max_length), max_length + 2, []
    for text, turn in pieces if side != "left" else reversed(pieces):
        if budget <= 0:
            break
        part = (cut_for_tokens if side != "left" else tail_for_tokens)(text, tokenizer, budget, size)
        piece_ids = tokenizer(part, add_special_tokens=False)["input_ids"]
        budget -= len(piece_ids)
        kept.append((piece_ids, turn))
    return kept if side != "left" else kept[::-1]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict]) -> list[int]:
    """Ids of ``messages`` with the generation prompt, cut at answer boundaries as training cuts them
    (:func:`assistant_token_mask`; whole for ``{% generation %}`` templates), so inference sees the ids training saw."""
    if not GENERATION_MARKER.search(template):
        try:
            return assistant_token_mask(tokenizer, template, messages, [], generation_prompt=True)[0]
        except TemplateError:
            pass  # training refused such a template already; the prompt alone still renders
    return tokenizer(render(tokenizer, template, messages, generation_prompt=True), add_special_tokens=False)["input_ids"]


def generation_token_mask(
    tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict], turns: list[int]
) -> tuple[list[int], list[int]]:
    """As :func:`assistant_token_mask`, from ``{% generation %}`` markers; runs of marked tokens are numbered in turn order."""
    encoded = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assistant_turns = [index for index, turn in enumerate(messages) if turn["role"] == "assistant"]
    owner, run, previous = [], -1, 0
    for marked in encoded["assistant_masks"]:
        if marked and not previous:
            run += 1
        turn = assistant_turns[run] if marked and run < len(assistant_turns) else -1
        owner.append(turn if turn in turns else -1)
        previous = marked
    return list(encoded["input_ids"]), owner


def answer_labels(ids: list[int], owner: list[int], eot_id: int, eot: str, open_end: bool = False) -> list[int]:
    """Labels: each marked run (and an end-of-turn token right after it), cut after its last end-of-turn token; -100 elsewhere.
    ``open_end``: ``ids`` stop inside the conversation (a long row tokenised only as far as truncation keeps): a run reaching
    the end is labelled to it, as the whole row's labels are there.

    Raises:
        TemplateError: a run has no end-of-turn token (``eot``, its text): the model would never learn to stop.
    """
    labels = [IGNORE_INDEX] * len(ids)
    index = 0
    while index < len(ids):
        if owner[index] < 0:
            index += 1
            continue
        end = index
        while end < len(ids) and owner[end] == owner[index]:
            end += 1
        if end < len(ids) and ids[end] == eot_id and eot_id not in ids[index:end]:
            end += 1  # the template closes the turn right after the marked content
        closing = [position for position in range(index, end) if ids[position] == eot_id]
        if open_end and end == len(ids):
            closing = [end - 1]
        if not closing:
            raise TemplateError(
                f"an assistant turn is not closed by the end-of-turn token {eot!r} (id {eot_id}), so the model would not learn "
                "to stop; fix: data.end_of_turn=<the token the template ends assistant turns with>"
            )
        labels[index : closing[-1] + 1] = ids[index : closing[-1] + 1]
        index = end
    return labels


def special_token_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Every special token's text (EOS, BOS, pad, chat markers...), longest first: text tokenised as one control token."""
    texts = set(tokenizer.all_special_tokens) | {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return sorted((text for text in texts if text), key=len, reverse=True)


def special_token_problem(messages: list[dict], specials: list[str], where: str) -> str | None:
    """A line naming the first turn whose content spells a special token, or ``None``."""
    for number, turn in enumerate(messages):
        found = sorted((token for token in specials if token in turn["content"]), key=turn["content"].index)
        if found:
            return (
                f"{where}: turn {number} ({turn['role']}) spells the special token(s) {', '.join(map(repr, found))} in its content, which "
                "tokenisation would read as that control token (a quoted end of turn trained as a real one, a user message "
                "forging turns); fix: remove or escape it in the data (e.g. write it with spaces inside), or drop the row"
            )
    return None


def tokenize_conversations(
    batch: dict[str, list],
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    system_prompt: str | None,
    train_on: str,
    eot_id: int,
    max_length: int,
    truncation: str,
    split: str,
    rule: str = "",
    columns: dict[str, str] | None = None,
    roles: dict[str, str] | None = None,
) -> dict[str, list]:
    """Render, tokenise and label a batch of rows (a ``datasets`` map; ``rule``: :data:`LABEL_RULE`, for the cache key).

    Returns per row ``input_ids``, ``labels`` (-100 where not trained), ``length``, ``n_trained`` (0: dropped), ``n_content``
    (trained labels other than end-of-turn; 0: no answer text), ``truncated`` (tokens cut; -1: cut, uncounted, a rendering over
    ``piece_chars(max_length)`` characters tokenised only as far as kept) and ``row`` (index in the split).

    Raises:
        DataError: a malformed row, ``train_on=completion`` on a multi-turn row, no assistant turn, a turn spelling a special token.
        TemplateError: see :func:`answer_labels`.
    """
    names = list(batch)
    out = {"input_ids": [], "labels": [], "length": [], "n_trained": [], "n_content": [], "truncated": [], "row": []}
    use_markers = bool(GENERATION_MARKER.search(template))
    specials = special_token_texts(tokenizer)
    for offset, index in enumerate(indices):
        where = f"data.splits.{split} row {index}"
        messages, completion_row = conversation({c: batch[c][offset] for c in names}, system_prompt, where, columns, roles)
        if train_on == "completion" and not completion_row:
            raise DataError(
                f"{where} is a multi-turn row, but data.train_on=completion needs prompt/completion (or Alpaca) rows; "
                "fix: data.train_on=assistant"
            )
        problem = special_token_problem(messages, specials, where)
        if problem:
            raise DataError(problem)
        try:
            ids, labels, long = label_conversation(
                tokenizer, template, messages, train_on, eot_id, use_markers, where, (max_length, truncation)
            )
        except jinja2.TemplateError as error:  # the template itself raised (e.g. roles out of the order it accepts)
            raise TemplateError(
                f"{where}: the chat template failed on this row: {type(error).__name__}: {error}; fix: the row (e.g. the "
                "roles in the order the template accepts), or another data.chat_template"
            ) from error
        except TemplateError as error:
            raise TemplateError(f"{where}: {error}") from error
        cut = max(0, len(ids) - max_length)
        if cut:
            ids, labels = (ids[cut:], labels[cut:]) if truncation == "left" else (ids[:max_length], labels[:max_length])
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["n_trained"].append(sum(label != IGNORE_INDEX for label in labels[1:]))  # position 0 is never a target
        out["n_content"].append(sum(label not in (IGNORE_INDEX, eot_id) for label in labels[1:]))
        out["truncated"].append(-1 if long and cut else cut)  # (-1: a long row's cut tokens, never tokenised, uncounted)
        out["row"].append(index)
    return out


def label_conversation(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    messages: list[dict],
    train_on: str,
    eot_id: int,
    use_markers: bool,
    where: str,
    keep: tuple[int, str] | None = None,
) -> tuple[list[int], list[int], bool]:
    """Token ids and labels of one conversation (:func:`tokenize_conversations`), and whether they are only the part a
    truncation to ``keep=(max_length, side)`` keeps (a rendering over ``piece_chars(max_length)`` characters, cut as plain text
    is: :func:`bounded`; not with ``{% generation %}`` markers, whose template tokenises the whole).

    Raises:
        DataError: no assistant turn.  TemplateError: see :func:`answer_labels`; jinja2.TemplateError: the template raised.
    """
    if train_on == "all":
        text = render(tokenizer, template, messages)
        long = keep is not None and not use_markers and len(text) > piece_chars(keep[0])
        if long:
            text = (cut_for_tokens if keep[1] != "left" else tail_for_tokens)(text, tokenizer, keep[0], piece_chars(keep[0]))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, list(ids), long
    turns = [i for i, turn in enumerate(messages) if turn["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where} has no assistant turn, so nothing to train on or to score; fix: add the answer, or data.train_on=all")
    if train_on == "last_assistant":
        turns = turns[-1:]
    if use_markers:
        (ids, owner), long = generation_token_mask(tokenizer, template, messages, turns), False
    else:
        ids, owner, long = assistant_token_mask(tokenizer, template, messages, turns, keep=keep)
    labels = answer_labels(ids, owner, eot_id, tokenizer.convert_ids_to_tokens(eot_id), open_end=long and keep[1] != "left")
    return ids, labels, long


def pack_rows(lengths: list[int], block_size: int) -> list[list[int]]:
    """Group rows of ``lengths`` tokens (each ``<= block_size``) into blocks: best fit, longest first, each row whole in one
    block; blocks in the order of their first row."""
    room: list[tuple[int, int]] = []  # (free tokens, block index), sorted
    blocks: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        place = bisect.bisect_left(room, (lengths[row], -1))
        if place < len(room):
            free, block = room.pop(place)
        else:
            free, block = block_size, len(blocks)
            blocks.append([])
        blocks[block].append(row)
        bisect.insort(room, (free - lengths[row], block))
    return [sorted(block) for block in sorted(blocks, key=min)]


def packed_block(batch: dict[str, list], rows: list[int]) -> dict[str, list[int]]:
    """Concatenate ``rows``: ids, labels (each row's first -100: not a target of the row before) and position ids from 0 per row."""
    ids, labels, positions = [], [], []
    for row in rows:
        ids += batch["input_ids"][row]
        labels += [IGNORE_INDEX] + batch["labels"][row][1:]
        positions += list(range(len(batch["input_ids"][row])))
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "length": len(ids)}


class ChatCollator:
    """Pad chat rows (or packed blocks) on the right into ``(B, T)`` int64 ``input_ids``, ``labels`` (-100 on padding),
    ``token_mask`` (1 = a real token) and ``attention_mask``, or for packed blocks ``position_ids`` (from 0 per row) instead;
    ``T`` is the longest row rounded up to ``pad_to_multiple_of``."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None, packed: bool) -> None:
        self.pad_token_id, self.pad_to_multiple_of, self.packed = pad_token_id, pad_to_multiple_of, packed

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        shape = (len(rows), longest)
        batch = {
            "input_ids": torch.full(shape, self.pad_token_id, dtype=torch.long),
            "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
            "token_mask": torch.zeros(shape, dtype=torch.long),
        }
        if self.packed:
            batch["position_ids"] = torch.zeros(shape, dtype=torch.long)
        for index, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][index, :n] = torch.as_tensor(row["input_ids"])
            batch["labels"][index, :n] = torch.as_tensor(row["labels"])
            batch["token_mask"][index, :n] = 1
            if self.packed:
                batch["position_ids"][index, :n] = torch.as_tensor(row["position_ids"])
                batch["position_ids"][index, n:] = torch.arange(longest - n)
        if not self.packed:
            batch["attention_mask"] = batch["token_mask"].clone()
        return batch


def row_format_names(columns: object, roles: object) -> tuple[dict[str, str], dict[str, str]]:
    """``data.columns`` and ``data.roles`` checked, as dicts (``roles`` ``None``: :data:`SHAREGPT_ROLES`).

    Raises:
        ConfigError: a ``columns`` key that is no row field or value that is no column name; a ``roles`` value that is no role.
    """
    columns, roles = dict(columns or {}), dict(roles) if roles is not None else dict(SHAREGPT_ROLES)
    for name, column in columns.items():
        if name not in ROW_FIELDS or not isinstance(column, str) or not column:
            raise ConfigError(
                f"data.columns.{name}={column!r}: data.columns maps the row fields {ROW_FIELDS} to your file's column names; "
                "fix: e.g. data.columns.instruction=question data.columns.output=answer"
            )
    for speaker, role in roles.items():
        if role not in ROLES:
            raise ConfigError(f"data.roles.{speaker}={role!r} is not one of {ROLES}; fix: e.g. data.roles.{speaker}=user")
    return columns, roles


MIX_UNTIL = ("first_exhausted", "all_exhausted")  # datasets.interleave_datasets' stopping strategies


def mix_problems(splits: dict, ratios: object, until: object) -> list[str]:
    """Problems of a training-file mix (``data.splits.train`` list, ``data.mix_ratios``, ``data.mix_until``); ``[]`` when fine."""
    train = splits.get("train")
    if isinstance(train, str) or train is None:
        if ratios is not None:
            return [
                f"data.mix_ratios={ratios!r} needs data.splits.train as a list of files to mix; fix: "
                "'data.splits.train=[a.jsonl,b.jsonl]' with as many ratios, or data.mix_ratios=null"
            ]
        return []
    problems = []
    files = list(train)
    if not files or not all(isinstance(file, str) and file for file in files):
        problems.append(
            f"data.splits.train={files!r} must be a file or a non-empty list of files; fix: 'data.splits.train=[a.jsonl,b.jsonl]'"
        )
    if not splits.get("validation"):
        problems.append(
            "data.splits.train is a list of files and data.splits.validation is null: a validation split is not cut from a "
            "mix; fix: data.splits.validation=path/to/val.jsonl"
        )
    if ratios is not None:
        values = list(ratios) if not isinstance(ratios, str) else None
        if values is None or len(values) != len(files):
            problems.append(
                f"data.mix_ratios={ratios!r} must be a list of {len(files)} shares, one per file of data.splits.train; "
                f"fix: e.g. data.mix_ratios=[{','.join(['0.5'] * 2)}] for two files"
            )
        elif not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values):
            problems.append(
                f"data.mix_ratios={values!r}: every share must be a number > 0 (a file with no share is left out of "
                "data.splits.train instead); fix: positive shares that sum to 1"
            )
        elif abs(sum(values) - 1) > 1e-6:
            problems.append(f"data.mix_ratios={values!r} sums to {sum(values):g}, not 1; fix: shares that sum to 1, e.g. [0.7, 0.3]")
    if until not in MIX_UNTIL:
        problems.append(f"data.mix_until={until!r} is not one of {MIX_UNTIL}; fix: data.mix_until=first_exhausted")
    return problems


class ChatDataModule(TokenizedDataModule):
    """Causal-LM batches of chat rows, loss on the answers (module docstring): ``input_ids``, ``labels``, ``token_mask`` and
    ``attention_mask`` (``pad``) or ``position_ids`` (``pack_rows``), each ``(micro_batch, T)``, ``T <= max_length`` rounded up.

    Args (the ``data`` group's keys, and :class:`...core.data.batching.TokenizedDataModule`'s; ``train`` may be a list of files):
        mix_ratios: ``None``: the files one after the other; else a share per file (> 0, sum 1), rows drawn at random in these
            shares (``datasets.interleave_datasets``, seeded by ``mix_seed``: the same mix every run and rank) until ``mix_until``:
            ``first_exhausted`` (no row repeats) or ``all_exhausted`` (smaller files repeat).
        chat_template: ``None`` (the tokenizer's), a shipped name or a ``.jinja`` path; set on the tokenizer (checkpoints carry it).
        answer_rows: the first test rows whose answers are generated for ``test/exact_match``; ``None`` = all.

    Raises (from ``setup``, before any weights load):
        ConfigError: unknown ``mode``/``train_on``/``truncation``, no chat template, an end-of-turn token not in the vocabulary.
        DataError / TemplateError: a malformed row, a template whose answer spans cannot be found.
    """

    SIDE_PREFIXES = ("",)  # the column prefixes of the sequences a tokenised row holds (inspect_data)
    BATCH_ITEM = "sequences"  # what a kept row becomes (for the log)

    def __init__(
        self,
        *,
        chat_template: str | None,
        system_prompt: str | None,
        end_of_turn: str | None,
        train_on: str,
        truncation: str,
        mode: str,
        answer_rows: int | None,
        answer_max_new_tokens: int,
        columns: dict[str, str] | None = None,
        roles: dict[str, str] | None = None,
        mix_ratios: list[float] | None = None,
        mix_until: str = "first_exhausted",
        mix_seed: int = 0,
        answer_batch_size: int = 16,
        **shared: object,
    ) -> None:
        super().__init__(**shared)
        if not isinstance(answer_batch_size, int) or isinstance(answer_batch_size, bool) or answer_batch_size < 1:
            raise ConfigError(
                f"data.answer_batch_size={answer_batch_size!r} must be a positive number of prompts; fix: e.g. data.answer_batch_size=16"
            )
        self.answer_batch_size = answer_batch_size
        problems = mix_problems(dict(shared["splits"]), mix_ratios, mix_until)
        if problems:
            raise ConfigError("; ".join(problems))
        self.mix_ratios = [float(v) for v in mix_ratios] if mix_ratios is not None else None
        self.mix_until, self.mix_seed = mix_until, mix_seed
        self.columns, self.roles = row_format_names(columns, roles)
        for field, value, allowed in (("mode", mode, CHAT_MODES), ("train_on", train_on, TRAIN_ON), ("truncation", truncation, TRUNCATION)):
            if value not in allowed:
                raise ConfigError(f"data.{field}={value!r} is not one of {allowed}; fix: data.{field}={' or '.join(allowed)}")
        self.chat_template, self.system_prompt, self.end_of_turn = chat_template, system_prompt, end_of_turn
        self.train_on, self.truncation, self.mode = train_on, truncation, mode
        self.answer_rows, self.answer_max_new_tokens = answer_rows, answer_max_new_tokens
        self.template: str | None = None
        self.eot_id: int | None = None
        self.raw: dict[str, datasets.Dataset] = {}
        self.token_counts: dict[str, int] = {}  # real (non-pad) tokens per split
        self.dropped: dict[str, list[int]] = {}  # rows with no trained token, per split
        self.answers: dict[str, list[dict]] = {}  # answer_prompts, per split

    def prepare_tokenizer(self) -> None:
        """Load the tokenizer, resolve the template (set on the tokenizer) and the end-of-turn id."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        if self.template is None:
            self.template = resolve_chat_template(self.tokenizer, self.chat_template)
            self.tokenizer.chat_template = self.template  # saved with the tokenizer: generate/export render alike
            self.eot_id = end_of_turn_id(self.tokenizer, self.end_of_turn)
            pad_token_id(self.tokenizer)

    def setup(self, stage: str) -> None:
        """Load, render, tokenise and label what ``stage`` needs (cached on disk by ``datasets``)."""
        self.prepare_tokenizer()
        if stage in ("fit", "validate") and "train" not in self.datasets:
            if "validation" in self.splits:  # (always, for a mix of train files: mix_problems)
                train, validation = self.split_rows("train"), self.split_rows("validation")
            else:  # (the whole file read first: a bad row is named by its row in data.splits.train)
                train, validation = self.hold_out_rows(self.tokenized("train", self.load("train")))
            self.datasets["train"] = self._prepare("train", train)
            self.datasets["validation"] = self._prepare("validation", validation)
        # The test split is checked too (train scores the untuned model on it): a bad test row stops the run before weights load.
        if stage in ("fit", "validate", "test") and self.has_test and "test" not in self.datasets:
            self.datasets["test"] = self._prepare("test", self.split_rows("test"))
        if stage == "test" and "test" not in self.datasets:
            raise DataError("data.splits.test is null, so there is no test split to evaluate; fix: data.splits.test=path/to/test.jsonl")
        if stage in ("fit", "validate"):
            self.check_validation_interval()

    def hold_out_rows(self, tokenized: datasets.Dataset) -> tuple[datasets.Dataset, datasets.Dataset]:
        """:meth:`hold_out_validation` of a tokenised train split by its file rows (``row``): the sequences of a row (a pair's
        two answers for KTO) stay on one side, in the order the held-out rows are drawn."""
        at: dict[int, list[int]] = {}
        for index, row in enumerate(tokenized["row"]):
            at.setdefault(row, []).append(index)
        rows = datasets.Dataset.from_dict({"row": list(at)})
        kept, held = self.hold_out_validation(rows, "row", "data.splits.validation=path/to/val.jsonl, or more rows")
        return tuple(tokenized.select([i for row in part["row"] for i in at[row]]) for part in (kept, held))

    def mixes(self, split: str) -> bool:
        """Whether ``split`` is a list of files to mix (``train`` only)."""
        return isinstance(self.splits.get(split), list)

    def split_rows(self, split: str) -> datasets.Dataset:
        """The split's rows tokenised and labelled, none dropped; a list of files is read file by file (``part``: the
        file's index) and mixed by ``mix_ratios``/``mix_until`` (``row`` stays the index in its own file)."""
        if not self.mixes(split):
            return self.tokenized(split, self.load(split))
        parts = []
        for index, source in enumerate(self.splits[split]):
            label = f"{split}[{index}]"  # messages name data.splits.train[i]
            rows = self.tokenized(label, load_split(label, source, self.hub_name, self.hub_config, self.cache_dir))
            parts.append(rows.add_column("part", [index] * len(rows)))
        if self.mix_ratios is None:
            return datasets.concatenate_datasets(parts)
        mixed = datasets.interleave_datasets(parts, probabilities=self.mix_ratios, seed=self.mix_seed, stopping_strategy=self.mix_until)
        drawn = Counter(mixed["part"])
        log.info(
            "data.splits.%s: %s mixed with shares %s until %s: %s rows",
            split,
            len(parts),
            self.mix_ratios,
            self.mix_until,
            ", ".join(f"{drawn[i]} of {len(part)} from [{i}]" for i, part in enumerate(parts)),
        )
        return mixed

    def load(self, split: str) -> datasets.Dataset:
        """The split's raw rows (kept for ``inspect_data`` and the exact-match answers)."""
        if split not in self.raw:
            self.raw[split] = load_split(split, self.splits[split], self.hub_name, self.hub_config, self.cache_dir)
        return self.raw[split]

    def tokenized(self, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
        """Every row rendered, tokenised, labelled and truncated (none dropped yet)."""
        kwargs = {
            "tokenizer": self.tokenizer,
            "template": self.template,
            "system_prompt": self.system_prompt,
            "train_on": self.train_on,
            "eot_id": self.eot_id,
            "max_length": self.max_length,
            "truncation": self.truncation,
            "split": split,
            "rule": LABEL_RULE,
            "columns": self.columns,
            "roles": self.roles,
        }
        return dataset.map(
            tokenize_conversations,
            batched=True,
            with_indices=True,
            fn_kwargs=kwargs,
            remove_columns=dataset.column_names,
            desc=f"Rendering {split}",
        )

    def _prepare(self, split: str, tokenized: datasets.Dataset) -> datasets.Dataset:
        """Drop (and count) rows with no trained token, pack for ``mode=pack_rows``."""
        self.split_sizes[split] = len(tokenized)
        trained = tokenized["n_trained"]
        drops = {reason: at for reason, at in self.drops(tokenized).items() if at}
        self.dropped[split] = sorted(tokenized[index]["row"] for at in drops.values() for index in at)
        for reason, at in drops.items():
            rows = [tokenized[index]["row"] for index in at[:10]]
            log.warning("data.splits.%s: dropped %d of %d rows %s (rows %s)", split, len(at), len(tokenized), reason, rows)
        answerless = [row for row, n, content in zip(tokenized["row"], trained, tokenized["n_content"]) if n and not content]
        if answerless:
            log.warning(
                "data.splits.%s: %d rows train no answer text, only the end-of-turn token (an empty answer, or one truncated "
                "away; rows %s): they teach the model to stop at once; fix: the rows' answers, or a larger data.max_length",
                split,
                len(answerless),
                answerless[:10],
            )
        gone = {index for at in drops.values() for index in at}
        kept = tokenized.select([index for index in range(len(tokenized)) if index not in gone]) if gone else tokenized
        if len(kept) == 0:
            raise DataError(
                f"data.splits.{split}: no row is left to train on within data.max_length={self.max_length} (see the warnings "
                "above); fix: a larger data.max_length"
            )
        truncated = sum(1 for n in kept["truncated"] if n)
        if truncated:
            log.warning(
                "data.splits.%s: %d rows longer than data.max_length=%d were truncated (%s)",
                split,
                truncated,
                self.max_length,
                self.truncation,
            )
        kept = self.finish(split, kept.select_columns(self.kept_columns()))
        self.token_counts[split] = self.count_tokens(kept)
        log.info("%s: %d rows -> %d %s, %d tokens", split, len(tokenized), len(kept), self.BATCH_ITEM, self.token_counts[split])
        return kept

    def drops(self, rows: datasets.Dataset) -> dict[str, list[int]]:
        """The rows of a tokenised split that train, eval and ``inspect_data`` drop, by reason: ``{reason and fix: [index in
        rows, ...]}``.  Here: rows with no trained token left after truncation."""
        reason = (
            f"with no trained token left after truncation to data.max_length={self.max_length}; fix: a larger data.max_length "
            "or data.truncation=left (see inspect_data)"
        )
        return {reason: [index for index, n in enumerate(rows["n_trained"]) if n == 0]}

    def kept_columns(self) -> list[str]:
        """The tokenised columns a batch is made of."""
        return ["input_ids", "labels", "length"]

    def finish(self, split: str, kept: datasets.Dataset) -> datasets.Dataset:
        """The split as batches read it, from its kept rows: packed into blocks for ``pack_rows``."""
        if self.mode != "pack_rows":
            return kept
        blocks = pack_rows(kept["length"], self.max_length)
        columns = {"input_ids": kept["input_ids"], "labels": kept["labels"]}
        return datasets.Dataset.from_list([packed_block(columns, rows) for rows in blocks])

    def count_tokens(self, kept: datasets.Dataset) -> int:
        """Real (non-pad) tokens of a finished split."""
        return sum(kept["length"])

    @property
    def groups_by_length(self) -> bool:
        return self.mode == "pad" and self.group_by_length

    def sequence_lengths(self, split: str) -> list[int]:
        return self.datasets[split]["length"]

    def collator(self) -> ChatCollator:
        return ChatCollator(pad_token_id(self.tokenizer), self.pad_to_multiple_of, packed=self.mode == "pack_rows")

    def answer_prompts(self, split: str = "test") -> list[dict]:
        """The first ``answer_rows`` rows ending in an assistant answer as ``{"row", "prompt_ids", "reference"}`` (the prompt
        before it, with the generation prompt, and its text); cached per split (train scores before and after tuning on them)."""
        if split in self.answers:
            return self.answers[split]
        self.prepare_tokenizer()
        rows, unanswered = [], 0
        for index, row in enumerate(self.load(split)):
            messages, _ = conversation(row, self.system_prompt, f"data.splits.{split} row {index}", self.columns, self.roles)
            if messages[-1]["role"] != "assistant":
                unanswered += 1
                continue
            prompt_ids = chat_prompt_ids(self.tokenizer, self.template, messages[:-1])
            rows.append({"row": index, "prompt_ids": prompt_ids, "reference": messages[-1]["content"]})
            if self.answer_rows is not None and len(rows) >= self.answer_rows:
                break
        if unanswered:
            log.warning("data.splits.%s: %d rows do not end with an assistant answer and are not scored for exact match", split, unanswered)
        self.answers[split] = rows
        return rows
