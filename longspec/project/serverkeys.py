"""Which key each regeneration server gets, and from where: the one owner of that rule, read by
`longspec regenerate` (to refuse a mistake before a process starts) and by
`python -m longspec.regenerate` (which reads the keys themselves).

A key comes from an environment variable only, never the command line (it would show in `ps`,
shell history and an sbatch script): OPENAI_API_KEY by default (the OpenAI clients' convention; no
header when it is unset), or the variable `--api-key-env NAME` names: once for every server, or
once per `--server` in the same order. A named variable that is unset or empty is refused. A
server URL with credentials in it (`https://user:pass@host`) is refused, its credentials not shown.

Messages here name variables, never their values (nor a name that reads like a key). Pure: os, re
and urllib.parse only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_ENV = "OPENAI_API_KEY"


class KeyProblem(ValueError):
    """A server list or key variable that cannot be used; the message shows no secret."""


@dataclass(frozen=True)
class ServerKey:
    url: str
    env: str            # the variable read
    named: bool         # named with --api-key-env (else the default, optional)


def shown(url: str) -> str:
    """The URL with any credentials in it masked."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc="***@" + host + (f":{parts.port}" if parts.port else "")))


def plan(servers: list[str], key_envs: list[str]) -> list[ServerKey]:
    """The variable each server's key is read from; KeyProblem for credentials in a URL, a count
    of --api-key-env that fits neither one nor one per server, or a named variable that is unset."""
    for url in servers:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KeyProblem(f"--server {shown(url)}: an http:// or https:// URL")
        if parts.query or parts.fragment:
            bare = urlunsplit(parts._replace(query="", fragment=""))
            raise KeyProblem(f"--server {shown(bare)}?...: a query or fragment in a server URL is not sent and "
                             "would show in `ps`, logs and the manifest (a key there?); give the base URL "
                             f"(http://HOST:PORT/v1) and the key in an environment variable ({DEFAULT_ENV})")
        if parts.username is not None or parts.password is not None:
            raise KeyProblem(f"--server {shown(url)}: credentials in a URL would show in `ps`, logs and the "
                             f"manifest; give the URL without them and the key in an environment variable "
                             f"({DEFAULT_ENV}, or --api-key-env NAME)")
    if key_envs and not servers:
        raise KeyProblem("--api-key-env is for --server: the local target needs no key")
    if len(key_envs) not in (0, 1, len(servers)):
        raise KeyProblem(f"--api-key-env given {len(key_envs)} times for {len(servers)} servers: "
                         "give it once (every server) or once per --server, in the same order")
    names = key_envs if len(key_envs) == len(servers) else key_envs * len(servers) or [DEFAULT_ENV] * len(servers)
    out = [ServerKey(u, n, bool(key_envs)) for u, n in zip(servers, names)]
    for k in out:
        if not k.env.isidentifier():
            raise KeyProblem("--api-key-env takes the name of an environment variable, not a key (what was "
                             "given is not shown: it may be one)")
        value = os.environ.get(k.env) or ""
        if value and (value != value.strip() or not value.isprintable() or not value.isascii()):
            raise KeyProblem(f"{k.env}: the key holds spaces, control characters (a line end?) or non-ASCII "
                             "characters, which an HTTP header cannot carry; set it again without them "
                             "(the value is not shown)")
        if k.named and not os.environ.get(k.env):
            if not looks_like_a_name(k.env):
                raise KeyProblem(f"--api-key-env: no variable of that name is set, and the name given ({len(k.env)} "
                                 "characters, not shown) reads like a key, not a variable name: give the name of the "
                                 "variable that holds the key (VLLM_KEY), never the key")
            raise KeyProblem(f"--api-key-env {k.env}: the variable is not set (export {k.env}=... first)")
    return out


def looks_like_a_name(name: str) -> bool:
    """An environment variable's name as people write them (VLLM_KEY_1, OPENAI_API_KEY): upper
    case, short; anything else may be a key and is not shown back."""
    return bool(re.fullmatch(r"[A-Z_][A-Z0-9_]{0,47}", name))


def key_of(k: ServerKey) -> str | None:
    """The key itself (None: no header). Only the process that sends requests calls this."""
    return os.environ.get(k.env) or None
