"""One definition of the scenario flags, shared by every command that builds a scenario.

    from pdcheck.cliopts import scenario_flags

    @app.command()
    @scenario_flags
    def handshake(scenario: ... = None, *, overrides: dict[str, Any], vllm: ... = None) -> None:
        sc = framework.load(scenario, overrides)

`scenario_flags` replaces the command's `overrides` parameter (which is not a flag) with the flags below,
as typer reads the signature, and hands the command the overrides dict built from them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup


def _no_flag_metavars(params: list[Any]) -> list[Any]:
    """An on/off flag takes no value: no `<bool>` in the help's value column (--help and typer's completion
    flags included, which get no metavar of ours)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


def refuse_empty(command: Any, ctx: Any, args: list[str]) -> None:
    """A flag or argument given an empty value (`--error-mode=`, `--output ''`, an unset `$VAR`) is bad input,
    named, before anything runs: no pdcheck value is empty, and a default taken in its place would hide the
    mistake (an empty path would even read as the current directory). Read from the raw command line, before
    click converts the values; a command line click cannot parse is left for click to refuse."""
    from pdcheck.errors import BadInput

    try:
        opts, _rest, _order = command.make_parser(ctx).parse_args(args=list(args))
    except Exception:  # noqa: BLE001 - click's own usage errors follow from super().parse_args
        return
    for p in command.get_params(ctx):
        got = opts.get(p.name)
        for v in got if isinstance(got, (list, tuple)) else [got]:
            if isinstance(v, str) and not v.strip():
                if getattr(p, "param_type_name", "") == "option":
                    raise BadInput(f"{max(p.opts, key=len)}: an empty value; give one, or leave the flag out")
                raise BadInput(f"{p.metavar or p.name.upper()}: an empty value; give one")


class Command(TyperCommand):
    """Every pdcheck command's class (`@app.command(cls=Command)`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _no_flag_metavars(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        refuse_empty(self, ctx, args)
        return super().parse_args(ctx, args)


class Group(TyperGroup):
    """Every pdcheck command group's class."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _no_flag_metavars(super().get_params(ctx))


# Flags several commands take, declared once.
Device = Annotated[str, typer.Option(metavar="cpu|cuda", rich_help_panel="Run",
                                     help="Where KV caches live: cpu (host memory) or cuda (GPU memory, VRAM).")]

PANEL_SCENARIO = "Scenario"
PANEL_SIDES = "Per-side overrides"

SIDES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One scenario flag: the command parameter `name`, its scenario key and side(s)."""

    name: str  # parameter name; the flag is --name-with-dashes unless decls say otherwise
    type: Any  # the Python type typer converts to (every flag is optional: None = not given)
    help: str
    metavar: str | None  # "" for an on/off flag: no value column
    panel: str
    key: str  # scenario key in [prefill] / [decode]
    sides: tuple[str, ...]  # both sides for a shared flag, one for a per-side override
    decls: tuple[str, ...] = ()

    def option(self) -> Any:
        return typer.Option(*self.decls, help=self.help, metavar=self.metavar, rich_help_panel=self.panel,
                            show_default=False)


# (key, type, metavar, help for the shared flag or None when there is no shared flag, per-side help)
_KEYS: tuple[tuple[str, Any, str | None, str | None, str], ...] = (
    ("block_size", int, "TOKENS", "Tokens per KV block, both sides.", "Tokens per KV block"),
    ("layers", int, "N", "Attention layers, both sides.", "Attention layers"),
    ("kv_heads", int, "N", "Total KV heads of the model (all TP ranks together), both sides.", "Total KV heads"),
    ("head_dim", int, "N", "Head dim (MLA: the latent dim), both sides.", "Head dim (MLA: latent dim)"),
    ("dtype", str, "DTYPE", "KV cache dtype, both sides: bfloat16, float16, float32 or fp8.", "KV cache dtype"),
    ("kv_cache_layout", str, "LAYOUT", "KV cache layout, both sides: HND or NHD (or a 0.31+ enum name).",
     "KV cache layout"),
    ("attn_backend", str, "NAME", "Attention backend name, both sides (e.g. FLASH_ATTN_VLLM_V1).",
     "Attention backend name"),
    ("engine_id", str, "ID", None, "Engine id"),
)


def _flags() -> tuple[Flag, ...]:
    out = [
        Flag("prefill_tp", int, "Prefill tensor-parallel size.", "N", PANEL_SCENARIO, "tp_size", ("prefill",)),
        Flag("decode_tp", int, "Decode tensor-parallel size.", "N", PANEL_SCENARIO, "tp_size", ("decode",)),
        Flag("prefill_blocks", str, "Prefill num_blocks: one number for every rank, or one per rank, "
             "e.g. 5808,5800.", "N[,N...]", PANEL_SCENARIO, "num_blocks", ("prefill",)),
        Flag("decode_blocks", str, "Decode num_blocks: one number for every rank, or one per rank.", "N[,N...]",
             PANEL_SCENARIO, "num_blocks", ("decode",)),
    ]
    for key, typ, metavar, shared_help, _ in _KEYS:
        if shared_help is not None:
            out.append(Flag(key, typ, shared_help, metavar, PANEL_SCENARIO, key, SIDES))
    out.append(Flag("use_mla", bool, "MLA model (one replicated latent KV head per rank), both sides.", "",
                    PANEL_SCENARIO, "use_mla", SIDES, ("--use-mla/--no-mla",)))
    out.append(Flag("host", str, "Side-channel host, both sides (default 127.0.0.1: loopback only).", "HOST",
                    PANEL_SCENARIO, "host", SIDES))
    for key, typ, metavar, shared_help, side_help in _KEYS:
        for side in SIDES:
            wins = f" (wins over --{key.replace('_', '-')})" if shared_help is not None else ""
            out.append(Flag(f"{side}_{key}", typ, f"{side_help}, {side} side only{wins}.", metavar, PANEL_SIDES,
                            key, (side,)))
    out.append(Flag("prefill_base_port", int, "Prefill side-channel base port (rank r listens on base + r).",
                    "PORT", PANEL_SIDES, "base_port", ("prefill",)))
    return tuple(out)


FLAGS: tuple[Flag, ...] = _flags()
FLAG_NAMES: frozenset[str] = frozenset(f.name for f in FLAGS)
# The request path's deployment shape (pdcheck.requests.shapes): TP and DP per side, the same keys as a scenario's
# [prefill] / [decode] tables (`pdcheck requests --prefill-tp 2 --decode-dp 2`).
SHAPE_FLAGS: tuple[Flag, ...] = (
    *(f for f in FLAGS if f.key == "tp_size"),
    Flag("prefill_dp", int, "Prefill data-parallel size (engines, each a TP group).", "N", PANEL_SCENARIO, "dp_size",
         ("prefill",)),
    Flag("decode_dp", int, "Decode data-parallel size (engines, each a TP group).", "N", PANEL_SCENARIO, "dp_size",
         ("decode",)),
)


def overrides_from_flags(values: dict[str, Any], flags: tuple[Flag, ...] = FLAGS) -> dict[str, Any]:
    """Flag values (parameter name -> value or None) -> the overrides dict a framework's load takes.

    Shared flags set both sides; a per-side flag wins over its shared flag. Sides with nothing set are left out.
    """
    from pdcheck.scenariofile import parse_counts

    out: dict[str, dict[str, Any]] = {side: {} for side in SIDES}
    # Shared flags first so that the per-side ones, applied after, win.
    for flag in sorted(flags, key=lambda f: len(f.sides), reverse=True):
        val = values.get(flag.name)
        if val is None:
            continue
        if flag.key == "num_blocks":
            val = parse_counts("--" + flag.name.replace("_", "-"), val)
        for side in flag.sides:
            out[side][flag.key] = val
    return {side: v for side, v in out.items() if v}


F = TypeVar("F", bound=Callable[..., Any])


def scenario_flags(func: F) -> F:
    """Decorator: give a typer command every scenario flag, and call it with `overrides=<dict>` instead.

    The command must declare a parameter named `overrides` (not a flag; any annotation), anywhere: first, or
    keyword-only after `*` (Python wants no default-less parameter after defaulted ones). The flags take its
    place in the signature typer reads; the command is called with keywords only. A command parameter with a
    flag's name is an error.
    """
    return _with_flags(func, FLAGS)


def shape_flags(func: F) -> F:
    """scenario_flags with the shape flags only (SHAPE_FLAGS: TP and DP per side), for `pdcheck requests`."""
    return _with_flags(func, SHAPE_FLAGS)


def _with_flags(func: F, flags: tuple[Flag, ...]) -> F:
    names_of = frozenset(f.name for f in flags)
    sig = inspect.signature(func, eval_str=True)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    if "overrides" not in names:
        raise TypeError(f"{func.__qualname__}: @scenario_flags needs an `overrides` parameter")
    clash = names_of.intersection(names)
    if clash:
        raise TypeError(f"{func.__qualname__}: parameters {sorted(clash)} clash with scenario flags")
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
        raise TypeError(f"{func.__qualname__}: @scenario_flags commands take keyword parameters only")
    at = names.index("overrides")
    # typer calls commands with keywords only, so every parameter may become keyword-only: that keeps the
    # signature valid wherever `overrides` sits and whatever defaults surround it.
    kw = [p.replace(kind=p.KEYWORD_ONLY) if p.kind is p.POSITIONAL_OR_KEYWORD else p for p in params]
    added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[f.type | None, f.option()]) for f in flags]
    new_sig = sig.replace(parameters=[*kw[:at], *added, *kw[at + 1:]])

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name, None) for name in names_of}
        return func(overrides=overrides_from_flags(values, flags), **kwargs)

    # typer reads inspect.signature (which stops at __signature__) and get_type_hints (which reads
    # __annotations__); both must describe the flags, not the wrapped function.
    wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in new_sig.parameters.values()
                               if p.annotation is not inspect.Parameter.empty}
    if new_sig.return_annotation is not inspect.Signature.empty:
        wrapper.__annotations__["return"] = new_sig.return_annotation
    return wrapper  # type: ignore[return-value]


def release_flags(command: str, metavar: str = "RELEASES", panel: str = "Run") -> Callable[[F], F]:
    """Decorator: one release flag per registered framework that takes one in `command` (--vllm, --sglang, ...,
    help from the framework: pdcheck.frameworks), in place of the command's `releases` parameter, which the
    command then gets as {framework name: the flag's value or None}. Built when the command is, so a framework
    registered before then has its flag."""
    from pdcheck import frameworks

    def deco(func: F) -> F:
        sig = inspect.signature(func, eval_str=True)
        params = list(sig.parameters.values())
        names = [p.name for p in params]
        if "releases" not in names:
            raise TypeError(f"{func.__qualname__}: @release_flags needs a `releases` parameter")
        flags = {fw.name: fw.flag.lstrip("-").replace("-", "_") for fw in frameworks.supporting(command)
                 if fw.commands[command].release_help is not None}
        fws = {fw.name: fw for fw in frameworks.supporting(command)}
        at = names.index("releases")
        kw = [p.replace(kind=p.KEYWORD_ONLY) if p.kind is p.POSITIONAL_OR_KEYWORD else p for p in params]
        added = [inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
                     str | None, typer.Option(fws[name].flag, metavar=metavar, rich_help_panel=panel,
                                              show_default=False, help=fws[name].commands[command].release_help,
                                              autocompletion=complete_releases(name))])
                 for name, param in flags.items()]
        new_sig = sig.replace(parameters=[*kw[:at], *added, *kw[at + 1:]])

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            return func(releases={name: kwargs.pop(param, None) for name, param in flags.items()}, **kwargs)

        wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in new_sig.parameters.values()
                                   if p.annotation is not inspect.Parameter.empty}
        return wrapper  # type: ignore[return-value]

    return deco


def complete_scenario(incomplete: str) -> list[str]:
    """Shell completion of a SCENARIO argument (typer's autocompletion): the bundled names that start with
    what is typed."""
    from pdcheck import frameworks
    from pdcheck.scenariofile import bundled

    return [p.stem for p in bundled(frameworks.bundled_dirs()) if p.stem.startswith(incomplete)]


def complete_releases(framework: str) -> Callable[[str], list[str]]:
    """Shell completion of a release flag (--vllm 0.9.1,0.1<TAB>): the modelled lines' first releases and
    'all', for the last comma-separated item."""

    def complete(incomplete: str) -> list[str]:
        from pdcheck.catalog import release_names

        head, _, last = incomplete.rpartition(",")
        prefix = f"{head}," if head else ""
        return [prefix + n for n in [*release_names(framework), "all"] if n.startswith(last)]

    return complete
