"""parse_properties: java.util.Properties.load syntax.

Three oracles: (1) round trips of dicts serialised in many legal ways (hypothesis),
(2) hand-written examples, (3) java.util.Properties itself on random text (when a JDK
is installed)."""
from __future__ import annotations

import json
import random
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handler.config import PropertiesSyntaxError, parse_properties

WS = " \t\f"
TRICKY = st.sampled_from(list(" \t\f\n\r\\=:#!u\x0b\x85\u2028\ufeffé€😀"))
ANY_CHAR = st.characters(exclude_categories=["Cs"])
text_st = st.one_of(st.text(TRICKY, max_size=10), st.text(ANY_CHAR, max_size=10),
                    st.text(st.one_of(TRICKY, ANY_CHAR), max_size=10))


def _unicode_escape(c: str, upper: bool) -> str:
    units = c.encode("utf-16-be")
    hexes = [units[i:i + 2].hex() for i in range(0, len(units), 2)]
    return "".join("\\u" + (h.upper() if upper else h) for h in hexes)


def _token(data, c: str, *, in_key: bool, at_start: bool, after_ws_sep: bool) -> str:
    """One source character written in one of its legal spellings.
    at_start: first character of a key, of a value, or of a continuation chunk."""
    forced = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}
    if c in forced:
        return forced[c]
    must_escape = (
        (c in WS and (in_key or at_start))
        or (in_key and c in "=:")
        or (in_key and at_start and c in "#!")
        or (after_ws_sep and at_start and c in "=:")  # would be read as the separator
    )
    spellings = [] if must_escape else [c]
    spellings.append({"\t": "\\t", "\f": "\\f"}.get(c, "\\" + c) if c not in "tnrfu" else _unicode_escape(c, True))
    spellings.append(_unicode_escape(c, data.draw(st.booleans())))
    return data.draw(st.sampled_from(spellings))


def _serialise_entry(data, key: str, value: str) -> list[str]:
    """Natural lines (without terminators) of one entry, with continuations anywhere legal."""
    seps = ["=", ":", " = ", "\t:\t", " ", "\f", "  ="]
    if key == "":
        seps = [s for s in seps if s.strip(WS)]  # a bare-whitespace separator needs a key
    sep = data.draw(st.sampled_from(seps))
    ws_sep = not sep.strip(WS)
    nk, n = len(key), len(key) + len(value)
    # a break before position i; none between the key and a whitespace-only separator
    allowed = [i for i in range(n + 1) if not (i == nk and ws_sep)]
    breaks = set(data.draw(st.lists(st.sampled_from(allowed), max_size=3)))
    indent = st.sampled_from(["", " ", "   ", "\t", "\f "])
    out, chunk = [], data.draw(indent)
    for i, c in enumerate(key + value + "$"):
        if i in breaks:
            out.append(chunk + "\\")
            chunk = data.draw(indent)
        if i == nk:
            chunk += sep
        if i < n:
            chunk += _token(data, c, in_key=i < nk, at_start=i in (0, nk) or i in breaks,
                            after_ws_sep=ws_sep and i == nk)
    out.append(chunk)
    return out


def _join(data, lines: list[str]) -> str:
    text, prev = "", None
    for i, line in enumerate(lines):
        text += line
        if i == len(lines) - 1 and data.draw(st.booleans()):
            break  # no terminator after the last line
        # "\r" + "" + "\n" would read as one terminator
        choices = ["\r", "\r\n"] if line == "" and prev == "\r" else ["\n", "\r\n", "\r"]
        prev = data.draw(st.sampled_from(choices))
        text += prev
    return text


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.one_of(text_st, st.sampled_from(["a", "b"])), text_st), max_size=6),
       data=st.data())
def test_round_trip(pairs, data):
    lines: list[str] = []
    for key, value in pairs:
        extra = data.draw(st.sampled_from(["", "blank", "comment", "comment-backslash"]))
        if extra == "blank":
            lines.append(data.draw(st.sampled_from(["", " ", "\t\f "])))
        elif extra.startswith("comment"):
            body = data.draw(st.text(alphabet=st.characters(exclude_categories=["Cs"],
                                                            exclude_characters="\r\n"), max_size=8))
            lines.append(data.draw(st.sampled_from(["#", "!", "  #", "\t!"])) + body
                         + ("\\" if extra == "comment-backslash" else ""))
        lines.extend(_serialise_entry(data, key, value))
    text = _join(data, lines)
    assert parse_properties(text) == dict(pairs), repr(text)


# ---- hand examples -------------------------------------------------------------------
JAVA_DOC = """\
Truth = Beauty
 Truth:Beauty
Truth                    :Beauty
fruits                           apple, banana, pear, \\
                                  cantaloupe, watermelon, \\
                                  kiwi, mango
cheeses
"""


@pytest.mark.parametrize("text, expected", [
    (JAVA_DOC, {"Truth": "Beauty", "fruits": "apple, banana, pear, cantaloupe, watermelon, kiwi, mango",
                "cheeses": ""}),
    ("a=1\na=2\n", {"a": "2"}),
    ("a = 1 \n", {"a": "1 "}),                            # trailing whitespace kept, as Java does
    ("a==b\n", {"a": "=b"}),                              # only one separator consumed
    ("a : =b\n", {"a": "=b"}),
    ("a b c\n", {"a": "b c"}),
    ("a \t = b\n", {"a": "b"}),
    ("  # comment\n! also\nk=v\n", {"k": "v"}),
    ("# comment ends with \\\nk=v\n", {"k": "v"}),       # comments never continue
    ("k=v\\\n#not a comment\n", {"k": "v#not a comment"}),
    ("k=a\\\\\n", {"k": "a\\"}),                          # even backslashes: no continuation
    ("k=a\\\\\\\n  b\n", {"k": "a\\b"}),
    ("ke\\\n   y=v\n", {"key": "v"}),                     # continuation inside a key
    ("k=\\\n\nx=1\n", {"k": "", "x": "1"}),              # an empty continuation line ends it
    ("k=v\\", {"k": "v"}),                               # a backslash at end of input is dropped
    ("a\\=b=c\n", {"a=b": "c"}),
    ("a\\:b:c\n", {"a:b": "c"}),
    ("a\\ b c\n", {"a b": "c"}),
    ("\\#k=v\n", {"#k": "v"}),
    ("\\!k=v\n", {"!k": "v"}),
    ("k=\\t\\n\\r\\f\\\\\\b\\q\n", {"k": "\t\n\r\f\\bq"}),  # unknown escapes drop the backslash
    ("k=\\u0041\\u00e9\\uD83D\\uDE00\n", {"k": "Aé😀"}),  # surrogate pairs join
    ("k=\\ \\ x\n", {"k": "  x"}),                        # escaped leading whitespace kept
    ("k=v\r\nx=y\rz=w", {"k": "v", "x": "y", "z": "w"}),
    ("k=a\\\r\n  b\n", {"k": "ab"}),
    ("k=\x0b\x85\u2028v\n", {"k": "\x0b\x85\u2028v"}),    # not Java whitespace / line ends
    ("=v\n", {"": "v"}),
    (":v\n", {"": "v"}),
    ("", {}),
    ("\n\n  \t\n", {}),
    ("   \\\n  k=v\n", {"k": "v"}),
    ("option.entryPoint=djl_python.huggingface\n", {"option.entryPoint": "djl_python.huggingface"}),
])
def test_examples(text, expected):
    assert parse_properties(text) == expected


@pytest.mark.parametrize("text, line", [("k=\\u12\n", 1), ("a=1\n\nk\\uXYZW=v\n", 3), ("a=1\\\n  \\u00g0\n", 1)])
def test_malformed_unicode_escape(text, line):
    with pytest.raises(PropertiesSyntaxError) as e:
        parse_properties(text)
    assert e.value.line == line
    assert "\\uXXXX" in str(e.value)


# ---- differential test against java.util.Properties ----------------------------------
JAVA_SRC = r"""
import java.nio.file.*; import java.util.*; import java.io.*;
public class PropsOracle {
  static String hex(String s) { StringBuilder b = new StringBuilder();
    for (char c : s.toCharArray()) b.append(String.format("%04x", (int) c)); return b.toString(); }
  public static void main(String[] a) throws Exception {
    for (String f : a) {
      String text = new String(Files.readAllBytes(Paths.get(f)), "UTF-8");
      Properties p = new Properties();
      try { p.load(new StringReader(text)); } catch (IllegalArgumentException e) { System.out.println("ERR"); continue; }
      StringBuilder b = new StringBuilder();
      for (String k : p.stringPropertyNames()) b.append(hex(k)).append(',').append(hex(p.getProperty(k))).append(';');
      System.out.println(b.length() == 0 ? "-" : b.toString());
    }
  }
}
"""


def _unhex(h: str) -> str:
    return bytes.fromhex(h).decode("utf-16-be", "surrogatepass") if h else ""


@pytest.mark.skipif(shutil.which("java") is None, reason="no JDK installed: java.util.Properties oracle unavailable")
def test_against_java_properties(tmp_path):
    rng = random.Random(20240607)
    alphabet = ["a", "b", "k", " ", "\t", "\f", "=", ":", "#", "!", "\\", "\n", "\r", "\r\n", "u",
                "\\u0041", "\\u00", "\\uD83D\\uDE00", "é", "\x0b", "\\\n", "\\\r\n   ", "  "]
    texts = [JAVA_DOC] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
                          for _ in range(400)]
    files = []
    for i, t in enumerate(texts):
        f = tmp_path / f"{i}.properties"
        f.write_bytes(t.encode("utf-8", "surrogatepass"))
        files.append(str(f))
    src = tmp_path / "PropsOracle.java"
    src.write_text(JAVA_SRC)
    out = subprocess.run(["java", str(src), *files], capture_output=True, text=True, timeout=120, check=True)
    results = out.stdout.splitlines()
    assert len(results) == len(texts)
    for text, res in zip(texts, results):
        if res == "ERR":
            with pytest.raises(PropertiesSyntaxError):
                parse_properties(text)
            continue
        expected = {} if res == "-" else {
            _unhex(k): _unhex(v) for k, v in (kv.split(",") for kv in res.rstrip(";").split(";"))}
        assert parse_properties(text) == expected, json.dumps(text)
