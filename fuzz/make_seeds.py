#!/usr/bin/env python3
"""Writes the hand-written seed inputs of every fuzz target to fuzz/seeds/.

The seeds are committed; this script only documents how they were made
(valid tokens need the targets' fixed test secrets). Re-run it after changing
a target's input format:  python3 fuzz/make_seeds.py
"""

import base64
import hashlib
import hmac
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = os.path.join(HERE, "seeds")
# Must match SECRET_K1 / SECRET_K2 in fuzz/targets.rs.
K1 = b"fencer-fuzz-secret-k1-0123456789"
K2 = b"fencer-fuzz-secret-k2-0123456789"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def lease_tag(lease_id: str) -> str:
    return b64(hashlib.sha256(b"fencer-lease-tag:" + lease_id.encode()).digest()[:12])


def message(*parts: str) -> bytes:
    out = b""
    for p in parts:
        raw = p.encode()
        out += struct.pack(">I", len(raw)) + raw
    return out


def sign(secret, kid, key, token, lease, version="v2", token_text=None):
    token_text = str(token) if token_text is None else token_text
    mac = hmac.new(secret, message(version, kid, key, str(token), lease), hashlib.sha256)
    return f"{version}.{kid}.{token_text}.{lease}.{b64(key.encode())}.{b64(mac.digest())}"


def write(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def token_seeds():
    tag = lease_tag("Zq3vX9mN2pL8rT5wY1bC4d")
    valid = {
        "v2-account": sign(K1, "k1", "account:1", 34, tag),
        "v2-empty-key": sign(K1, "k1", "", 1, tag),
        "v2-dots-in-key": sign(K1, "k1", "a.b.c", 7, tag),
        "v2-utf8-key": sign(K1, "k1", "счёт:1/é", 2**40, tag),
        "v2-max-token": sign(K1, "k1", "k", 2**64 - 1, tag),
        "v1-lease-id": sign(K1, "k1", "account:1", 34, "abc", version="v1"),
        "k2-team-a": sign(K2, "k2", "team-a/orders", 5, tag),
        "k2-team-b": sign(K2, "k2", "team-b/orders", 5, tag),
    }
    for name, wire in valid.items():
        write("token_verify", name, wire)
    good = valid["v2-account"]
    p = good.split(".")
    bad = {
        "garbage": "garbage",
        "empty": "",
        "five-parts": ".".join(p[:5]),
        "seven-parts": good + ".x",
        "v3": "v3" + good[2:],
        "relabelled-v1": "v1" + good[2:],
        "unknown-kid": good.replace(".k1.", ".k9.", 1),
        "plus-token": good.replace(".34.", ".+34.", 1),
        "inflated": good.replace(".34.", ".35.", 1),
        "leading-zero": sign(K1, "k1", "account:1", 34, tag, token_text="034"),
        "token-overflow": good.replace(".34.", ".18446744073709551616.", 1),
        "lease-65": ".".join(p[:3] + ["a" * 65] + p[4:]),
        "lease-bad-char": ".".join(p[:3] + ["a+b"] + p[4:]),
        "key-padding": ".".join(p[:4] + [p[4] + "="] + p[5:]),
        "key-not-utf8": ".".join(p[:4] + [b64(b"\xff\xfe")] + p[5:]),
        "sig-truncated": good[:-3],
        "only-dots": ".....",
    }
    for name, wire in bad.items():
        write("token_verify", name, wire)

    def rt(name, op, pos, byte, kid, token, lease, key):
        header = bytes([op, pos >> 8, pos & 0xFF, byte])
        write("token_roundtrip", name, header + f"{kid}\n{token}\n{lease}\n{key}".encode())

    rt("plain", 0, 0, 0, "k1", 34, "Zq3vX9mN2pL8rT5wY1bC4d", "account:1")
    rt("replace-sig", 1, 90, ord("A"), "k1", 34, "lease", "account:1")
    rt("insert-zero-before-token", 2, 6, ord("0"), "k1", 34, "lease", "account:1")
    rt("insert-zero-after-v", 2, 1, ord("0"), "k1", 34, "lease", "account:1")
    rt("delete-dot", 3, 2, 0, "k1", 34, "lease", "account:1")
    rt("utf8-key", 1, 40, ord("."), "team-a", 2**63, "", "счёт:1\nwith newline.and.dots")
    rt("bad-kid", 2, 3, ord("x"), "has.dot", "not-a-number", "x" * 100, "")
    rt("long-key", 3, 300, 0, "k1", 0, "l", "k" * 512)


def path_seeds():
    paths = [
        "/", "", "a", "//", "//x", "/a/./b", "/a/../b", "/a/%2e%2e/b", "/a/%2E/b",
        "/a/%2e%2E", "/a/.%2e/b", "/a/b/", "/a//b", "/kv/accounts%2F2", "/kv/accounts%2f2",
        "/kv/accounts%5C2", "/kv/a\\b", "/kv/%61ccounts/2", "/kv/a%7e%3a", "/kv/a%20b",
        "/x/%C3%A9", "/x/é", "/x/🍕", "/kv/%zz", "/kv/%4", "/kv/%", "/kv/a..b",
        "/kv/a%2", "/kv/%25", "/kv/%2525", "/kv/%00", "/kv/%C0%AE%C0%AE/x", "/kv/%e0%80%ae",
        "/kv/a?x=%2F&y", "/kv/%61?q=1#frag", "http://h:1/kv/%61", "http://h:1/kv/%2e%2e/x",
        "http://h:1", "*", "h:80", "/kv/{\"json\":1}", "/a/b?", "/%7E%7e~", "/~/-/_/.a",
    ]
    for i, p in enumerate(paths):
        write("path_normalize", f"seed-{i:02}", p)
    # Overlong UTF-8 and invalid bytes (read lossily as U+FFFD).
    write("path_normalize", "overlong-utf8", b"/kv/\xc0\xae\xc0\xae/x")
    write("path_normalize", "invalid-utf8", b"/kv/\xff\xfe")


def route_seeds():
    routes = [
        ("/accounts/{id}", "account:{id}", "/accounts/42", ["42", "a b", "é/x"]),
        ("/kv/{a}/{b}", "kv:{b}:{a}", "/kv/x/y", ["x", "y"]),
        ("/kv/{a}/{a}", "kv:{a}", "/kv/1/2", ["1", "2"]),
        ("/", "root", "/", []),
        ("/static/key", "fixed", "/static/key", []),
        ("/a/{id}", "{id}", "/a/%2e%2e", [".", "..", ""]),
        ("/a/{id}", "x{id}y{id}", "/a/%C3%A9", ["é", "🍕", "%41", "%"]),
        ("/a/{id}", "k:{id}", "/a/é", ["é"]),
        ("/a/{id}/b", "k:{id}", "/a/%00/b", ["\u0000", "\t", "?#"]),
        ("/a/x{id}", "k:{id}", "/a/x1", ["1"]),
        ("/a/{id", "k:{id}", "/a/1", ["1"]),
        ("/a/{id}", "k:{nope}", "/a/1", ["1"]),
        ("/a/{id}/", "k:{id}", "/a/1/", ["1"]),
        ("/a//{id}", "k:{id}", "/a//1", ["1"]),
        ("/a/%61/{id}", "k:{id}", "/a/a/1", ["1"]),
        ("/a/%3A/{id}", "k:{id}", "/a/%3A/1", ["1"]),
        ("accounts/{id}", "k:{id}", "/accounts/1", ["1"]),
        ("/a/{id}", "", "/a/1", ["1"]),
        ("/a/{}", "k", "/a/1", ["1"]),
        ("/a/{i_d9}", "{i_d9}", "/a/%41", ["A"]),
    ]
    for i, (path, key, probe, values) in enumerate(routes):
        write("route_match", f"seed-{i:02}", "\n".join([path, key, probe] + values))


def key_seeds():
    keys = {
        "plain": "account:42",
        "empty": "",
        "slash-braces": "a/b{c}",
        "cyrillic": "счёт:1",
        "newline": "a\nb",
        "nul": "a\u0000",
        "del": "a\u007f",
        "c1-control": "a\u0085b",
        "max": "k" * 512,
        "too-long": "k" * 513,
        "utf8-at-limit": "é" * 256,
        "utf8-over-limit": "é" * 256 + "k",
        "control-in-long": "\n" * 600,
    }
    for name, k in keys.items():
        write("lock_key", name, k)
    write("lock_key", "invalid-utf8", b"k\xff")


def body_seeds():
    acquire = [
        "", "  \n", "{}", "null", "[1]", "not json", '"str"', "{",
        '{"ttl_ms":100,"wait_ms":300000,"owner":"w1"}',
        '{"ttl_ms":3600000,"wait_ms":0}',
        '{"ttl_ms":99}', '{"ttl_ms":3600001}', '{"ttl_ms":-1}', '{"ttl_ms":1.5}',
        '{"ttl_ms":1e3}', '{"ttl_ms":"100"}', '{"ttl_ms":null}', '{"wait_ms":300001}',
        '{"auto_renew":true,"keepalive_ms":2000}', '{"auto_renew":true}',
        '{"auto_renew":false,"keepalive_ms":2000}', '{"keepalive_ms":2000}',
        '{"auto_renew":"yes"}', '{"auto_renew":null,"keepalive_ms":null}',
        '{"owner":"' + "o" * 256 + '"}', '{"owner":"' + "o" * 257 + '"}',
        '{"owner":"a\\nb"}', '{"owner":"\\u0085"}', '{"owner":7}',
        '{"nope":1}', '{"ttl_ms":100,"ttl_ms":0}', '{"ttl_ms":18446744073709551616}',
        "[" * 200 + "]" * 200, '{"a":' * 130 + "1" + "}" * 130,
    ]
    for i, b in enumerate(acquire):
        write("request_body", f"acquire-{i:02}", b"\x00" + b.encode())
        write("request_body", f"hold-{i:02}", b"\x01" + b.encode())
    lease = [
        "", "{}", '{"lease_id":"abc"}', '{"lease_id":"a b"}', '{"lease_id":""}',
        '{"lease_id":"' + "a" * 64 + '"}', '{"lease_id":"' + "a" * 65 + '"}',
        '{"lease_id":"abc","ttl_ms":5000}', '{"lease_id":"abc","ttl_ms":5}',
        '{"lease_id":"abc","ttl_ms":null}', '{"lease_id":7}', '{"lease_id":"é"}',
        '{"lease_id":"abc","extra":true}',
    ]
    for i, b in enumerate(lease):
        write("request_body", f"renew-{i:02}", b"\x02" + b.encode())
        write("request_body", f"release-{i:02}", b"\x03" + b.encode())
    write("request_body", "invalid-utf8", b"\x00{\"owner\":\"\xff\"}")
    write("request_body", "overlong-utf8", b"\x00{\"owner\":\"\xc0\xae\"}")


def config_seeds():
    root = os.path.dirname(HERE)
    for name in sorted(os.listdir(os.path.join(root, "config"))):
        if name.endswith(".toml"):
            shutil.copy(os.path.join(root, "config", name), os.path.join(SEEDS, "config_load", name))
    extra = {
        "empty.toml": "",
        "unknown-section.toml": "[nope]\nx = 1\n",
        "unknown-field.toml": "[sidecar]\nnope = 1\n",
        "bad-range.toml": "[sidecar]\ndefault_ttl_ms = 5\n",
        "bad-kind.toml": '[backend]\nkind = "etcd"\n',
        "wrong-type.toml": '[sidecar]\ndefault_ttl_ms = "ten"\n',
        "negative.toml": "[sidecar]\ndefault_ttl_ms = -1\n",
        "huge.toml": "[sidecar]\ndefault_ttl_ms = 18446744073709551616\n",
        "float.toml": "[sidecar]\nclock_drift_ratio = nan\n",
        "redlock.toml": '[backend]\nkind = "redlock"\n[backend.redlock]\nurls = ["redis://a", "redis://b", "redis://c"]\n',
        "routes.toml": '[[gateway.routes]]\npath = "/kv/{id}"\nkey = "kv:{id}"\n[[gateway.routes]]\npath = "/kv/{id"\nkey = "x"\n',
        "keys.toml": '[[gateway.keys]]\nkey_id = "a"\nsecret_env = "NOPE"\nkey_prefixes = ["team-a/"]\n',
        "not-toml.toml": "{ this is not toml",
        "nested.toml": "a = " + "[" * 100 + "]" * 100 + "\n",
        "inline.toml": "sidecar = { default_ttl_ms = 1000 }\n",
        "dup.toml": "[sidecar]\ndefault_ttl_ms = 1000\ndefault_ttl_ms = 2000\n",
    }
    for name, text in extra.items():
        write("config_load", name, text)
    write("config_load", "invalid-utf8.toml", b"[sidecar]\nlisten = \"\xff\"\n")


if __name__ == "__main__":
    shutil.rmtree(SEEDS, ignore_errors=True)
    os.makedirs(os.path.join(SEEDS, "config_load"))
    token_seeds()
    path_seeds()
    route_seeds()
    key_seeds()
    body_seeds()
    config_seeds()
    for t in sorted(os.listdir(SEEDS)):
        print(t, len(os.listdir(os.path.join(SEEDS, t))))
