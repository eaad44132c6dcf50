"""PEFT's rank_pattern / alpha_pattern keys, matched in time linear in the module name.

The patterns come from a LoRA file's metadata, so they are untrusted, and Python's backtracking `re` takes
exponential time on some (`(a+)+$` against a long name never returns). A key is parsed by Python's own regex parser
(so it means what it means to PEFT), built into an automaton (a Thompson NFA, run as a DFA built lazily) and matched
as PEFT's get_pattern_key does, `re.match(rf"(.*\\.)?({key})$", name)`: the key matches the whole name or a suffix of
it that starts after a dot. Keys without repetition or alternation (the usual case: a module name) are matched by
`re`, which cannot backtrack on them, and is faster.

Refused (PatternError, naming what is wrong): invalid regexes, keys longer than MAX_PATTERN_CHARS, what is not
regular or not needed for module names (backreferences, lookarounds, conditionals, atomic groups, possessive
repeats, \\b, flags), automata over MAX_STATES states (e.g. `a{100000}`), names longer than MAX_NAME_CHARS, and
matching that would visit more than a Budget's automaton states (patterns that share one Budget -- a file's --
share the bound: matching them all takes a few seconds at most, against milliseconds for real files).
"""
import re

try:
    from re import _constants as _C
    from re import _parser as _P
except ImportError:  # Python 3.10 names them sre_*
    import sre_constants as _C
    import sre_parse as _P

MAX_PATTERN_CHARS = 512
MAX_NAME_CHARS = 1024
MAX_STATES = 1000
MAX_VISITS = 4_000_000            # automaton states visited and characters read while matching, per Budget
_MAX_DFA_STEPS = 4096             # cached steps per pattern; past it, steps are computed and not kept
_CATEGORIES = {_C.CATEGORY_DIGIT: r"\d", _C.CATEGORY_NOT_DIGIT: r"\D", _C.CATEGORY_SPACE: r"\s",
               _C.CATEGORY_NOT_SPACE: r"\S", _C.CATEGORY_WORD: r"\w", _C.CATEGORY_NOT_WORD: r"\W"}
_STARTS = (_C.AT_BEGINNING, _C.AT_BEGINNING_STRING)
_ENDS = (_C.AT_END, _C.AT_END_STRING)
_REPEATS = (_C.MAX_REPEAT, _C.MIN_REPEAT)
_CHAR, _SPLIT, _START, _END, _MATCH = range(5)
_FLAGS_OK = re.UNICODE | re.VERBOSE   # (VERBOSE only changes how the key was written)


class PatternError(ValueError):
    """A pattern key that is refused, or a name too long to match."""


def _char_class(items):
    """A one-character regex for the items of an IN node ([...], \\d, ...): it cannot backtrack."""
    out = []
    for op, av in items:
        if op is _C.NEGATE:
            out.insert(0, "^")
        elif op is _C.LITERAL:
            out.append(f"\\U{av:08x}")
        elif op is _C.RANGE:
            out.append(f"\\U{av[0]:08x}-\\U{av[1]:08x}")
        elif op is _C.CATEGORY and av in _CATEGORIES:
            out.append(_CATEGORIES[av])
        else:
            raise PatternError(f"unsupported character class item {op} {av}")
    rx = re.compile("[" + "".join(out) + "]")
    return lambda ch: rx.fullmatch(ch) is not None


class Budget:
    """Automaton states that matching may still visit (shared by the patterns given it)."""

    def __init__(self, visits=MAX_VISITS):
        self.total = self.left = int(visits)

    def spend(self, n):
        self.left -= n
        if self.left < 0:
            raise PatternError(f"matching the patterns would visit more than {self.total} automaton states")


class SuffixPattern:
    """One PEFT pattern key, checked and compiled; `matches(name)` is PEFT's get_pattern_key test for it.
    budget: a Budget shared with other patterns (default: one of its own)."""

    def __init__(self, key, budget=None):
        if not isinstance(key, str):
            raise PatternError(f"a pattern is a string, got {type(key).__name__}")
        if len(key) > MAX_PATTERN_CHARS:
            raise PatternError(f"{len(key)} characters, more than the {MAX_PATTERN_CHARS} a pattern may have")
        try:
            tree = _P.parse(key)
        except (re.error, RecursionError, OverflowError) as e:
            raise PatternError(f"not a valid regular expression ({e})") from None
        if tree.state.flags & ~_FLAGS_OK:
            raise PatternError("inline flags such as (?i) are not supported")
        self.key, self.states, self._work, self._choice = key, [], 0, False
        self.budget = budget if budget is not None else Budget()
        self.start = self._seq(tree, self._add(_MATCH, None, None))
        self._re = None if self._choice else re.compile(rf"(.*\.)?({key})$")
        self._first = self._closure([self.start], True)
        self._after_dot = self._closure([self.start], False)
        self._steps = {}

    # ------------------------------------------------------------------ building (backwards: each node gets its next)
    def _add(self, kind, arg, nxt):
        if len(self.states) >= MAX_STATES:
            raise PatternError(f"its automaton needs more than {MAX_STATES} states (a repeat count too large?)")
        self.states.append((kind, arg, nxt))
        return len(self.states) - 1

    def _seq(self, items, nxt):
        self._work += 1    # (an empty group repeated adds no state but still costs building time)
        if self._work > 4 * MAX_STATES:
            raise PatternError(f"too complex (more than {4 * MAX_STATES} parts once repeats are expanded)")
        for op, av in reversed(list(items)):
            nxt = self._one(op, av, nxt)
        return nxt

    def _one(self, op, av, nxt):
        if op is _C.LITERAL:
            return self._add(_CHAR, chr(av).__eq__, nxt)
        if op is _C.NOT_LITERAL:
            return self._add(_CHAR, chr(av).__ne__, nxt)
        if op is _C.ANY:
            return self._add(_CHAR, "\n".__ne__, nxt)
        if op is _C.IN:
            return self._add(_CHAR, _char_class(av), nxt)
        if op is _C.SUBPATTERN:
            _, add_flags, del_flags, body = av
            if add_flags or del_flags:
                raise PatternError("inline flags such as (?i:...) are not supported")
            return self._seq(body, nxt)
        if op is _C.BRANCH:
            self._choice = True
            return self._add(_SPLIT, [self._seq(alt, nxt) for alt in av[1]], nxt)
        if op in _REPEATS:
            self._choice = True
            lo, hi, body = av
            if lo > MAX_STATES or (hi != _C.MAXREPEAT and hi > MAX_STATES):
                raise PatternError(f"a repeat count over {MAX_STATES}")
            if hi == _C.MAXREPEAT:      # body* after the lo copies: a loop
                loop = self._add(_SPLIT, None, nxt)
                self.states[loop] = (_SPLIT, [self._seq(body, loop), nxt], nxt)
                start = loop
            else:                       # hi - lo optional copies, nested
                start = nxt
                for _ in range(hi - lo):
                    start = self._add(_SPLIT, [self._seq(body, start), nxt], nxt)
            for _ in range(lo):
                start = self._seq(body, start)
            return start
        if op is _C.AT and av in _STARTS:
            return self._add(_START, None, nxt)
        if op is _C.AT and av in _ENDS:
            return self._add(_END, None, nxt)
        what = {_C.GROUPREF: "backreferences", _C.GROUPREF_EXISTS: "conditionals", _C.ASSERT: "lookarounds",
                _C.ASSERT_NOT: "lookarounds", _C.AT: "word boundaries (\\b, \\B)",
                getattr(_C, "ATOMIC_GROUP", None): "atomic groups",
                getattr(_C, "POSSESSIVE_REPEAT", None): "possessive repeats"}.get(op, str(op).lower())
        raise PatternError(f"{what} are not supported in patterns (module names need none)")

    # ------------------------------------------------------------------ matching
    def _closure(self, states, at_start):
        """The character states, MATCH and pending end-anchors reachable from `states` without reading."""
        seen, stack, out = set(), list(states), set()
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            kind, arg, nxt = self.states[s]
            if kind == _SPLIT:
                stack.extend(arg)
            elif kind == _START:
                if at_start:
                    stack.append(nxt)
            else:
                out.add(s)
        self.budget.spend(len(seen))
        return frozenset(out)

    def _step(self, current, ch):
        got = self._steps.get((current, ch))
        if got is None:
            got = self._closure([self.states[s][2] for s in current
                                 if self.states[s][0] == _CHAR and self.states[s][1](ch)], False)
            if ch == ".":            # a suffix may start after any dot
                got = got | self._after_dot
            if len(self._steps) < _MAX_DFA_STEPS:
                self._steps[(current, ch)] = got
        return got

    def _accepts(self, current, at_start):
        seen, stack = set(), [s for s in current if self.states[s][0] in (_END, _MATCH)]
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            kind, arg, nxt = self.states[s]
            if kind == _MATCH:
                return True
            if kind == _SPLIT:
                stack.extend(arg)
            elif kind == _END or (kind == _START and at_start):
                stack.append(nxt)
        return False

    def matches(self, name):
        if len(name) > MAX_NAME_CHARS:
            raise PatternError(f"the module name is {len(name)} characters long, more than {MAX_NAME_CHARS}")
        if self._re is not None:
            self.budget.spend(1)    # (a pattern without choices: linear in C; counted so that many add up)
            return self._re.match(name) is not None
        self.budget.spend(len(name))
        current = self._first
        for ch in name:
            current = self._step(current, ch)
        return self._accepts(current, not name)
