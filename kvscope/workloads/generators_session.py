"""Workloads of growing contexts: multi-turn chat and multi-tenant sessions.

A turn's prompt is the previous turn's prompt + its forced `output_ids` + new user tokens,
so with the outputs forced the next turn really shares the whole previous context. Common
arguments and lengths as in `generators_prefix`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.workloads.request import TraceRequest
from kvscope.workloads.sampling import TokenSource, arrival_times, check_common, check_int, check_ints


@dataclass
class Session:
    """An open conversation. NOTE: `context` = last prompt + last output (the prefix alone
    before the first turn); the next turn's prompt extends it."""

    key: str
    user: str
    context: np.ndarray
    num_turns_done: int = 0

    def take_turn(self, source: TokenSource, new_len: int, output_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, forced output) of the next turn; the context grows by both."""
        prompt_ids = np.concatenate((self.context, source.varied_tokens(new_len)))
        output_ids = source.varied_tokens(output_len)
        self.context = np.concatenate((prompt_ids, output_ids))
        self.num_turns_done += 1
        return prompt_ids, output_ids


def multi_turn(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    num_turns: int = 4,
    max_open_conversations: int = 4,
    system_prompt_len: int = 32,
    first_prompt_len: int = 64,
    turn_len: int = 24,
    output_len: int = 16,
    num_users: int = 4,
) -> list[TraceRequest]:
    """Chat conversations of `num_turns` turns, interleaved: each request is the next turn of a
    conversation picked uniformly among the open ones; a new one opens when one finishes.

    Options (default):
        num_turns (4)               turns per conversation
        max_open_conversations (4)  conversations in flight at once
        system_prompt_len (32)      one system prompt every conversation starts with, exact; 0 for none
        first_prompt_len (64)       the first user message, varies ±50%
        turn_len (24)               each later user message, varies ±50%
        output_len (16)             forced output tokens per turn, varies ±50%
        num_users (4)               each conversation's user drawn from "u0".."u{num_users-1}"
    Request ids: "mt-c0003-t1" (conversation 3, turn 1; turns count from 0).
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(1, num_turns=num_turns, max_open_conversations=max_open_conversations, num_users=num_users)
    check_ints(1, first_prompt_len=first_prompt_len, turn_len=turn_len, output_len=output_len)
    check_int("system_prompt_len", system_prompt_len, minimum=0)
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    system_prompt = source.tokens(system_prompt_len)
    open_conversations: list[Session] = []
    num_opened = 0
    requests = []
    for i in range(num_requests):
        while len(open_conversations) < max_open_conversations:
            open_conversations.append(Session(f"c{num_opened:04d}", f"u{source.pick(num_users)}", system_prompt))
            num_opened += 1
        k = source.pick(len(open_conversations))
        conversation = open_conversations[k]
        rid = f"mt-{conversation.key}-t{conversation.num_turns_done}"
        new_len = turn_len if conversation.num_turns_done else first_prompt_len
        prompt_ids, output_ids = conversation.take_turn(source, new_len, output_len)
        requests.append(TraceRequest(rid, conversation.user, prompt_ids, output_ids.size, output_ids, arrivals[i]))
        if conversation.num_turns_done == num_turns:
            open_conversations.pop(k)
    return requests


def multi_tenant(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    num_tenants: int = 3,
    users_per_tenant: int = 3,
    common_prompt_len: int = 32,
    tenant_prompt_len: int = 64,
    first_turn_len: int = 32,
    turn_len: int = 16,
    output_len: int = 16,
    turns_per_session: int = 3,
) -> list[TraceRequest]:
    """Tenants with their own system prompts behind one common prompt; users with sessions.

    Every prompt starts with the common prompt, then its tenant's prompt. Each request comes
    from a user drawn uniformly among all users ("t1-u2": user 2 of tenant 1) and is the next
    turn of that user's session; after `turns_per_session` turns the user's next request opens
    a new session from the tenant prefix again.

    Options (default):
        num_tenants (3)          tenants, each with its own prompt
        users_per_tenant (3)     users per tenant
        common_prompt_len (32)   the prompt shared by all tenants, placed first, exact
        tenant_prompt_len (64)   each tenant's own prompt, after the common one, exact
        first_turn_len (32)      a session's first user message, varies ±50%
        turn_len (16)            each later user message, varies ±50%
        output_len (16)          forced output tokens per turn, varies ±50%
        turns_per_session (3)    turns before the user starts a new session
    Request ids: "mten-t1-u2-s0-t1" (user t1-u2, session 0, turn 1; all count from 0).
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(1, num_tenants=num_tenants, users_per_tenant=users_per_tenant, turns_per_session=turns_per_session)
    check_ints(1, common_prompt_len=common_prompt_len, tenant_prompt_len=tenant_prompt_len)
    check_ints(1, first_turn_len=first_turn_len, turn_len=turn_len, output_len=output_len)
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    common_prompt = source.tokens(common_prompt_len)
    tenant_prefixes = [np.concatenate((common_prompt, source.tokens(tenant_prompt_len))) for _ in range(num_tenants)]
    users = [(tenant, f"t{tenant}-u{u}") for tenant in range(num_tenants) for u in range(users_per_tenant)]
    sessions: dict[str, Session] = {}
    num_sessions: dict[str, int] = {}
    requests = []
    for i in range(num_requests):
        tenant, user = users[source.pick(len(users))]
        session = sessions.get(user)
        if session is None or session.num_turns_done == turns_per_session:
            session_index = num_sessions.get(user, 0)
            num_sessions[user] = session_index + 1
            session = sessions[user] = Session(f"{user}-s{session_index}", user, tenant_prefixes[tenant])
        rid = f"mten-{session.key}-t{session.num_turns_done}"
        new_len = turn_len if session.num_turns_done else first_turn_len
        prompt_ids, output_ids = session.take_turn(source, new_len, output_len)
        requests.append(TraceRequest(rid, user, prompt_ids, output_ids.size, output_ids, arrivals[i]))
    return requests
