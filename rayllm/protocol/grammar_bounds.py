"""Bounds on a client's regex or EBNF grammar that its size does not give: group nesting, repetition counts, and
repetitions nested in counted ones.

The last is what costs: xgrammar keeps a counter per open `{m,n}`, so when a repetition of variable count sits
inside (or around) a counted one, the matcher's states, and the time to fill each token's mask, grow as a power
of the output's length: `([a-z]{1,1000}){1,1000}` (23 characters) compiles in 0.4 s, then takes over a second to
fill one token's mask by the 46th token and 4 s soon after (xgrammar 0.2.8; docs/security.md). Nested `*` and
`+` alone (`(\\d+,)*`), a count around fixed-count items (`(\\d{3}-){1,1000}`) or around a group that starts or
ends with a delimiter nothing else in it matches (`(,[a-z]+){1,1000}`: where each repetition ends is then
plain), and a count inside `?` stay cheap. The check is conservative: a group with alternatives, or a rule that
refers to itself, has no delimiter it sees.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

from rayllm.protocol import limits as L

_COUNT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_DEFINES = re.compile(r"\s*::=")


class GrammarTooComplex(ValueError):
    """A bound this module checks; the message completes "<field> ..."."""


class Rep(NamedTuple):
    """What an item (an atom, a group, a rule) repeats, as far as the nesting bound cares."""

    product: float = 1  # the largest product of upper counts along a chain of repetitions in it (inf: unbounded)
    counted: bool = False  # that chain has a `{m,n}`
    variable: bool = False  # it repeats something a variable number of times
    run: int = 0  # the most long counted repetitions of variable count in a row in it (no delimiter between)

    def join(self, other: Rep) -> Rep:
        if other == self or other == NONE:
            return self
        return Rep(max(self.product, other.product), self.counted or other.counted, self.variable or other.variable,
                   max(self.run, other.run))


NONE = Rep()


def repeat(item: Rep, lo: float, hi: float, counted: bool, where: str) -> Rep:
    """`item` repeated lo..hi times (`counted`: written as `{m,n}`); GrammarTooComplex past MAX_NESTED_REPEAT."""
    if item.variable and hi > 1 and (counted or item.counted) and hi * item.product > L.MAX_NESTED_REPEAT:
        product = "past any bound" if math.isinf(hi * item.product) else f"to {int(hi * item.product)}"
        raise GrammarTooComplex(
            f"nests a repetition in a counted one ({where}): their counts multiply {product}, at most "
            f"{L.MAX_NESTED_REPEAT} are allowed (`*`, `+`, `{{m,}}` and recursion count as unbounded), as the work "
            f"to constrain each token grows with it (unless each repetition starts or ends with a character nothing "
            f"else in it matches, as `(,[a-z]+){{1,50}}`; or use `*`)")
    run = max(item.run, int(counted and lo != hi and hi > L.MAX_NESTED_REPEAT))
    if item.variable:
        return Rep(max(hi, 1) * item.product, counted or item.counted, True, run)
    return Rep(hi, counted, True, run) if lo != hi else NONE


def check_count(digits: str, where: str) -> int:
    if len(digits) > 9 or int(digits) > L.MAX_REPEAT_COUNT:
        times = digits if len(digits) <= 9 else f"more than {L.MAX_REPEAT_COUNT}"
        raise GrammarTooComplex(f"repeats something {times} times ({where}), at most {L.MAX_REPEAT_COUNT} "
                                "are allowed")
    return int(digits)


def _quote(text: str) -> str:
    """A piece of the client's text for a message, cut short."""
    return f"`{text}`" if len(text) <= 24 else f"`{text[:20]}...`"


def _skip_class(text: str, i: int) -> int:
    """The index after the character class that opens at text[i] ("[")."""
    i += 1
    i += text.startswith("^", i)
    i += text.startswith("]", i)  # `[]...]` and `[^]...]`: a leading `]` is a member
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i + 1


def tokens(text: str, ebnf: bool) -> Iterator[tuple]:
    """The parts of a regex or EBNF grammar the bounds need: ("lit", chars), ("atom", a regex for the characters
    a class or escape matches), ("ref", rule), ("def", rule), ("open",), ("close",), ("or",) and
    ("rep", lo, hi, counted, where); comments and group flags are skipped."""
    i, n = 0, len(text)
    while i < n:
        ch, start = text[i], i
        if ch == "\\":
            i += 2
            if text[i - 1:i] in ("p", "P", "x", "u", "N") and text.startswith("{", i):  # \p{L}, \x{41}
                i = text.find("}", i) + 1 or n
            escaped = text[start + 1:i]
            yield ("lit", escaped) if len(escaped) == 1 and not escaped.isalnum() else ("atom", text[start:i])
        elif ch == "[":
            i = _skip_class(text, i)
            yield ("atom", text[start:i])
        elif ch == "(":
            i += 1
            if not ebnf and text.startswith("?", i):  # (?:...), (?P<name>...), (?=...): not a quantifier
                i += 1
                if text.startswith(("P<", "<"), i) and not text.startswith(("<=", "<!"), i):
                    i = text.find(">", i) + 1 or n
            yield ("open",)
        elif ch in ")|":
            i += 1
            yield ("close",) if ch == ")" else ("or",)
        elif ch in "*+?":
            i += 1
            yield ("rep", 0 if ch != "+" else 1, 1 if ch == "?" else math.inf, False, f"`{ch}` at character {start}")
        elif ch == "{" and (m := _COUNT.match(text, i)) and (m[1] or m[3]):
            i, where = m.end(), f"{_quote(m[0])} at character {start}"
            lo = check_count(m[1], where) if m[1] else 0
            hi = lo if not m[2] else check_count(m[3], where) if m[3] else math.inf
            yield ("rep", lo, hi, True, where)
        elif ebnf and ch == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            try:
                chars = json.loads(text[start:i])  # EBNF's string escapes are JSON's
            except ValueError:
                chars = text[start + 1:i - 1]
            if chars:
                yield ("lit", chars)
        elif ebnf and ch == "#":
            i = text.find("\n", i) + 1 or n
        elif ebnf and (m := _NAME.match(text, i)):
            i = m.end()
            defines = _DEFINES.match(text, i)
            if defines:
                i = defines.end()
            yield ("def" if defines else "ref", m[0])
        else:
            i += 1
            if not ebnf:
                yield ("atom", ch) if ch in ".^$" else ("lit", ch)


def _may_match(atom: str, char: str) -> bool:
    """Whether a class or escape may match `char`; a long one (cached, it would hold the client's text) may."""
    return len(atom) > 64 or _may_match_short(atom, char)


@functools.lru_cache(maxsize=4096)
def _may_match_short(atom: str, char: str) -> bool:
    try:
        return re.fullmatch(atom, char) is not None
    except re.error:  # a class Python's re does not read (\p{L}, ...): it may
        return True


class _Group:
    """An open group (or a rule's body) while it is read."""

    def __init__(self) -> None:
        self.rep = NONE  # its items joined
        self.atoms: list[str] | None = []  # regexes for the characters it may match (None: any)
        self.first: str | None = None  # the character it starts with, when its first item is a literal
        self.last: str | None = None  # the character it ends with so far, when its last item is a literal
        self.items = 0
        self.alternatives = False
        self.sequences: list[list[tuple[int, str]]] = [[]]  # per alternative: (its items' run, literal or "")
        self._ends: dict[str, bool] = {}  # per literal character: whether it ends a row

    def add_atoms(self, atoms: list[str] | None) -> None:
        if self.atoms is not None and atoms is not None and len(self.atoms) + len(atoms) <= _MAX_ATOMS:
            self.atoms.extend(atoms)
        else:
            self.atoms = None

    def delimited(self) -> bool:
        """Every repetition of it starts (or ends) with a character nothing else in it matches: where one ends
        is then plain, and nesting counts in it costs nothing."""
        if self.alternatives or self.atoms is None:
            return False
        return any(c is not None and sum(_may_match(a, c) for a in self.atoms) == 1 for c in (self.first, self.last))

    def longest_run(self) -> int:
        """The most long counted repetitions of variable count in a row, a literal nothing else in the group
        matches ending a row. In a row (`[a-z]{0,1000}` three times) they cost as nested ones: 170 ms a token by
        the 120th, where two take 7 ms."""
        longest = 0
        for seq in self.sequences:
            if sum(run for run, _ in seq) <= L.MAX_ADJACENT_REPEATS:
                longest = max(longest, sum(run for run, _ in seq))
                continue
            row = 0
            for run, literal in seq:
                if literal and any(self._ends_row(c) for c in literal):
                    row = 0
                row += run
                longest = max(longest, row)
        if longest > L.MAX_ADJACENT_REPEATS:
            raise GrammarTooComplex(
                f"has {longest} counted repetitions of variable count up to more than {L.MAX_NESTED_REPEAT} in a row, "
                f"at most {L.MAX_ADJACENT_REPEATS} are allowed, as the work to constrain each token grows with them "
                "(unless a character between them that nothing else in their group matches ends the row)")
        return longest

    def _ends_row(self, char: str) -> bool:
        if self.atoms is None:
            return False
        if char not in self._ends:
            self._ends[char] = not any(_may_match(a, char) for a in self.atoms if a != re.escape(char))
        return self._ends[char]


_MAX_ATOMS = 256  # past this many classes and literals in a group its delimiters are not looked for


def evaluate(parts: list[tuple], ref: Callable[[str], tuple[Rep, list[str] | None]],
             max_nesting: int) -> tuple[Rep, list[str] | None]:
    """What a regex, or one rule's body, repeats, and the characters it may match (for a rule that refers to it);
    GrammarTooComplex past a bound. Iterative: no recursion per group."""
    stack: list[_Group] = []  # the enclosing groups
    group, last = _Group(), None  # the group being read, and its last item (a quantifier applies to it)
    for kind, *args in parts:
        if kind == "open":
            stack.append(group)
            if len(stack) > max_nesting:
                raise GrammarTooComplex(f"nests groups more than {max_nesting} deep, at most {max_nesting} "
                                        "levels are allowed")
            group, last = _Group(), None
            continue
        if kind == "or":
            group.alternatives, last = True, None
            group.sequences.append([])
            continue
        if kind == "rep":
            if last is not None:
                last = repeat(last, *args)
                group.rep = group.rep.join(last)
                group.sequences[-1][-1] = (last.run, "")
                group.last = None
                if group.items == 1:
                    group.first = None
            continue
        if kind == "close" and stack:
            inner, group = group, stack.pop()
            last = inner.rep._replace(run=inner.longest_run())
            if inner.delimited():
                last = last._replace(variable=False)
            group.add_atoms(inner.atoms)
            edge = None
        elif kind == "ref":
            last, atoms = ref(args[0])
            group.add_atoms(atoms)
            edge = None
        else:  # a literal or a class
            last = NONE
            group.add_atoms([re.escape(c) for c in args[0]] if kind == "lit" else list(args))
            edge = args[0] if kind == "lit" else None
        group.items += 1
        if group.items == 1:
            group.first = edge[0] if edge else None
        group.last = edge[-1] if edge else None
        group.rep = group.rep.join(last)
        group.sequences[-1].append((last.run, edge or ""))
    return group.rep._replace(run=group.longest_run()), group.atoms


def check_regex(pattern: str) -> Rep:
    return evaluate(list(tokens(pattern, ebnf=False)), lambda _: (NONE, None), L.MAX_REGEX_NESTING)[0]


def check_ebnf(grammar: str) -> Rep:
    """What the grammar's rules repeat, joined. Each rule's body is evaluated after the rules it refers to; a
    rule on a cycle repeats its body (as `*`)."""
    bodies: dict[str, list[tuple]] = {}
    body: list[tuple] = []
    for part in tokens(grammar, ebnf=True):
        if part[0] == "def":
            body = bodies.setdefault(part[1], [])
        else:
            body.append(part)
    if len(bodies) > L.MAX_GRAMMAR_RULES:
        raise GrammarTooComplex(f"has {len(bodies)} rules, at most {L.MAX_GRAMMAR_RULES} are allowed")
    refs = {name: [p[1] for p in parts if p[0] == "ref" and p[1] in bodies] for name, parts in bodies.items()}
    done: dict[str, tuple[Rep, list[str] | None]] = {}
    joined = NONE
    for component in _components(refs):
        members = set(component)
        recursive = len(component) > 1 or component[0] in refs[component[0]]
        rep, atoms = NONE, []
        known = functools.partial(_known, members, done)
        for name in component:
            one, its_atoms = evaluate(bodies[name], known, L.MAX_GRAMMAR_NESTING)
            rep = rep.join(repeat(one, 0, math.inf, False, f"rule `{name}` refers to itself") if recursive else one)
            atoms = None if atoms is None or its_atoms is None else list(dict.fromkeys(atoms + its_atoms))
        done.update(dict.fromkeys(component, (rep, atoms if atoms is None or len(atoms) <= _MAX_ATOMS else None)))
        joined = joined.join(rep)
    return joined


def _known(members: set[str], done: dict[str, tuple[Rep, list[str] | None]], rule: str
           ) -> tuple[Rep, list[str] | None]:
    """A rule's repetitions and characters, as far as known: none from a rule being evaluated, or an undefined one."""
    return (NONE, None) if rule in members else done.get(rule, (NONE, None))


def _components(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components, each after those it refers to (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if child < len(graph[node]):
                work.append((node, child + 1))
                nxt = graph[node][child]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out
