"""The ticket-triage prompt shared by the pipeline examples, and the bundled sample tickets.

    from prompts import build_prompt, load_tickets, parse_output
    prompts = [build_prompt(row) for row in load_tickets()]

``examples/data/support_tickets.jsonl`` holds 24 made-up support tickets (``ticket_id``,
``product``, ``channel``, ``text``). The demo model's weights are random, so its replies rarely
follow the format and ``parse_output`` then gives ``None`` fields: that is expected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TICKETS_PATH = Path(__file__).resolve().parent / "data" / "support_tickets.jsonl"
CATEGORIES = ("billing", "technical", "shipping", "account", "feature_request", "other")
URGENCIES = ("low", "medium", "high")

# The template also drives the CLI job (``--prompt-template examples/data/triage_prompt.txt``).
TEMPLATE = (Path(__file__).resolve().parent / "data" / "triage_prompt.txt").read_text(encoding="utf-8")

# "category: billing; urgency: high" -> the value after each label, up to ';' or end of line.
_FIELD_PATTERNS = {
    name: re.compile(rf"\b{name}\s*:\s*([^;\n]*)", re.IGNORECASE)
    for name in ("category", "urgency")
}


def build_prompt(row: dict) -> str:
    """The triage prompt for one ticket row (needs ``product``, ``channel`` and ``text``).

    Example:
        >>> prompt = build_prompt({"product": "Router", "channel": "chat", "text": "No signal."})
        >>> prompt.splitlines()[-1]
        'Ticket: No signal.'
    """
    return TEMPLATE.format(product=row["product"], channel=row["channel"], text=row["text"])


def load_tickets(path: str | Path | None = None) -> list[dict]:
    """Rows of a tickets jsonl file (default: the bundled ``data/support_tickets.jsonl``).

    Example:
        >>> len(load_tickets())
        24
    """
    with open(path or TICKETS_PATH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_output(text: str | None) -> dict:
    """``{"category": ..., "urgency": ...}`` from a model reply; a field is None when absent.

    Example:
        >>> parse_output("category: Billing; urgency: high")
        {'category': 'billing', 'urgency': 'high'}
        >>> parse_output("random words")
        {'category': None, 'urgency': None}
    """
    parsed = {}
    for name, pattern in _FIELD_PATTERNS.items():
        match = pattern.search(text or "")
        value = match.group(1).strip().lower() if match else ""
        parsed[name] = value or None
    return parsed
