"""Fitting a chat that outgrew the model's context: leave out, or summarise, its oldest turns.

A long chat eventually asks for more tokens than the model's context holds, and the engine refuses
it. Rather than fail every later message, the pane offers (screens/context_full.py) to leave the
oldest exchanges out of the prompt, or to replace them with a summary the model writes; the history
keeps every message either way. What was chosen stays in force for the pane's later messages, and is
saved with the session, so a restart does not ask again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

CONTEXT_ERROR_START = "This model's maximum context length is"
"""How the engine and OpenAI-compatible servers word a prompt too long for the context."""

SUMMARY_INTRO = "Summary of the earlier conversation (its oldest turns are left out to fit the context):"

SUMMARY_REQUEST = (
    "Summarise the conversation below in a few sentences: the facts, names, decisions and open "
    "questions a reader needs to go on with it. Write only the summary."
)


def is_context_error(error: BaseException) -> bool:
    return str(error).startswith(CONTEXT_ERROR_START)


@dataclass(frozen=True)
class ContextFit:
    """How a pane's prompts are cut down: ``dropped`` oldest exchanges left out, or summarised."""

    mode: str
    """"drop" or "summarise"."""
    dropped: int = 0
    summary: str = ""

    def more(self) -> ContextFit:
        """One more exchange left out (its summary, if any, is stale until written again)."""
        return replace(self, dropped=self.dropped + 1, summary="")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None) -> ContextFit | None:
        """The fit a session saved, or None (nothing saved, or a record this version cannot read)."""
        if not isinstance(saved, dict) or saved.get("mode") not in ("drop", "summarise"):
            return None
        dropped, summary = saved.get("dropped", 0), saved.get("summary", "")
        if not isinstance(dropped, int) or dropped < 0 or not isinstance(summary, str):
            return None
        return cls(saved["mode"], dropped, summary)


def split_messages(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[list[dict[str, str]]]]:
    """(leading system messages, the rest in exchanges: each starts at a user message)."""
    head = [m for m in messages[: _first_non_system(messages)]]
    exchanges: list[list[dict[str, str]]] = []
    for message in messages[len(head) :]:
        if message["role"] == "user" or not exchanges:
            exchanges.append([])
        exchanges[-1].append(message)
    return head, exchanges


def _first_non_system(messages: list[dict[str, str]]) -> int:
    return next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))


def can_drop(messages: list[dict[str, str]], dropped: int) -> bool:
    """Whether an older exchange is left to leave out (the last, holding the new question, never is)."""
    return dropped < len(split_messages(messages)[1]) - 1


def dropped_part(messages: list[dict[str, str]], dropped: int) -> list[dict[str, str]]:
    """The messages of the ``dropped`` oldest exchanges (what a summary covers)."""
    return [m for exchange in split_messages(messages)[1][:dropped] for m in exchange]


def fit_messages(messages: list[dict[str, str]], fit: ContextFit | None) -> list[dict[str, str]]:
    """The prompt with the oldest exchanges left out (and their summary beside the system prompt)."""
    if fit is None or fit.dropped == 0:
        return messages
    head, exchanges = split_messages(messages)
    # (Never the last exchange, which holds the new question: a fit saved on a longer branch, or in an
    # earlier run, may count more exchanges than the branch shown now has.)
    dropped = min(fit.dropped, max(len(exchanges) - 1, 0))
    kept = [m for exchange in exchanges[dropped:] for m in exchange]
    if fit.mode == "summarise" and fit.summary:
        note = f"{SUMMARY_INTRO}\n{fit.summary}"
        if head:
            head = [{**head[0], "content": f"{head[0]['content']}\n\n{note}"}, *head[1:]]
        else:
            head = [{"role": "system", "content": note}]
    return head + kept


def summary_request(part: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages that ask the model to summarise ``part`` (as one transcript in one user turn)."""
    transcript = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in part)
    return [{"role": "user", "content": f"{SUMMARY_REQUEST}\n\n{transcript}"}]
