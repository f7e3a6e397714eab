"""``--set NAME=VALUE[,NAME=VALUE ...]``: changes to a launch plan's numbers, the one way the tools vary a launch.

A change names a field of :class:`fastkda.PrefillPlan` (or :class:`fastkda.DecodePlan`) that is a launch number,
not one of the facts the plan is made for (shape, gate, SMs: those come from the inputs), and is applied with the
plan's ``.replace(...)``, which validates the values. A name the plan does not have is an error: it would
otherwise time the unchanged kernels under a wrong label.
"""

from __future__ import annotations

import argparse
import dataclasses

from fastkda.plan import DecodePlan, PrefillPlan

FACTS = {  # what a plan is made for, not how it launches
    PrefillPlan: ("seq_len", "num_seqs", "varlen", "heads", "key_dim", "value_dim", "lower_bound_gate", "sms"),
    DecodePlan: ("num_seqs", "heads", "value_dim"),
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def changeable_fields(plan_class=PrefillPlan):
    """``{name: type name}`` of the fields ``--set`` may change."""
    return {f.name: str(f.type) for f in dataclasses.fields(plan_class)
            if f.name not in FACTS[plan_class] and f.name != "reason"}


def _value(name, kind, text):
    if kind == "bool":
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"{name} takes 0/1 or true/false, got {text!r}")
        return text.lower() in TRUE
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} takes an integer, got {text!r}") from None
    return text


def parse_changes(text, plan_class=PrefillPlan):
    """``"prepare_warps=8,solve_stages=2"`` -> ``{"prepare_warps": 8, "solve_stages": 2}``; raises ``ValueError``
    for a name that is not a launch number of ``plan_class`` or a value of the wrong kind."""
    fields = changeable_fields(plan_class)
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{item!r} is not NAME=VALUE")
        if name not in fields:
            raise ValueError(f"{plan_class.__name__} has no launch number {name!r}; it has {', '.join(fields)}")
        changes[name] = _value(name, fields[name], value.strip())
    return changes


def combined(changes_list):
    """One set of changes from several ``--set`` arguments (a later one wins)."""
    return {name: value for changes in changes_list for name, value in changes.items()}


def add_set_argument(parser, plan_class=PrefillPlan, dest="set", flag="--set", what="launch numbers of the plan",
                     fixed=()):
    """``flag NAME=VALUE[,NAME=VALUE] ...`` on ``parser``: a list of change dicts; an unknown name, or one of the
    ``fixed`` names the tool sets itself, a usage error."""
    def parse(text):
        try:
            changes = parse_changes(text, plan_class)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        clash = [name for name in changes if name in fixed]
        if clash:
            raise argparse.ArgumentTypeError(f"{', '.join(clash)}: this tool sets it itself")
        return changes

    names = [name for name in changeable_fields(plan_class) if name not in fixed]
    parser.add_argument(flag, nargs="*", default=[], type=parse, dest=dest, metavar="NAME=VALUE[,...]",
                        help=f"{what} to change ({plan_class.__name__} fields: {', '.join(names)})")


def parse_arguments(parser, argv=None):
    """``(args, changes)``: ``parser``'s arguments and the changes of all its ``--set`` arguments in one."""
    args = parser.parse_args(argv)
    return args, combined(args.set)


def describe(changes):
    """``name=value,...`` of a set of changes ("the plan as chosen" when empty)."""
    return ",".join(f"{name}={value}" for name, value in changes.items()) or "the plan as chosen"
