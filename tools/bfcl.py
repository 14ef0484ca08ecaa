"""Berkeley Function Calling Leaderboard data, read offline from the `bfcl-eval` wheel.

    pip download --no-deps bfcl-eval==2026.3.23      # then pass the .whl (or its unpacked dir)

Only the non-"live" categories are used. What this module gives:
- `Bfcl(path)`: the data files of a wheel or an unpacked wheel directory;
- `tool_schema(fn, language)`: a BFCL function doc as an OpenAI-shape tool whose `parameters` is
  valid JSON Schema (BFCL's own types "dict", "float", "tuple", "any", Java's "String" ... mapped);
- `single_turn(bfcl, category)`: tasks with their question, tools and one ground-truth call list;
- `multi_turn(bfcl, category)`: multi-turn tasks, with `MultiTurnRun` executing the ground-truth
  calls against BFCL's own executable backends (file system, trading bot, ...) for real results.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

SINGLE_TURN = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
               "parallel_multiple", "irrelevance")
MULTI_TURN = ("multi_turn_base", "multi_turn_long_context")
MULTI_TURN_EXTRA = ("multi_turn_miss_param",)  # drafter data only: the target never saw them
BACKEND = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
BACKENDS = {  # class name -> (module, function doc file)
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
STATELESS = {"MathAPI"}

JSON_TYPES = {
    "dict": "object", "object": "object", "HashMap": "object",
    "float": "number", "double": "number", "number": "number",
    "integer": "integer", "int": "integer", "long": "integer",
    "string": "string", "String": "string", "char": "string",
    "boolean": "boolean", "Boolean": "boolean",
    "array": "array", "tuple": "array", "ArrayList": "array", "Array": "array",
}


class Bfcl:
    """The data directory of a bfcl-eval wheel; a .whl is unpacked next to itself once."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.suffix == ".whl":
            unpacked = path.with_suffix("")
            if not (unpacked / "bfcl_eval").is_dir():
                with zipfile.ZipFile(path) as z:
                    z.extractall(unpacked)
            path = unpacked
        if not (path / "bfcl_eval" / "data").is_dir():
            raise FileNotFoundError(f"{path}: not a bfcl-eval wheel or unpacked wheel")
        self.root = path
        self.data = path / "bfcl_eval" / "data"

    def rows(self, name: str) -> list[dict]:
        return [json.loads(line) for line in (self.data / name).read_text().splitlines()
                if line.strip()]

    def answers(self, category: str) -> dict[str, Any]:
        return {r["id"]: r["ground_truth"]
                for r in self.rows(f"possible_answer/BFCL_v4_{category}.json")}

    def backend_docs(self, class_name: str) -> list[dict]:
        return self.rows(f"multi_turn_func_doc/{BACKENDS[class_name][1]}")

    def backend_class(self, class_name: str) -> type:
        if str(self.root) not in sys.path:
            sys.path.insert(0, str(self.root))
        module = importlib.import_module(f"{BACKEND}.{BACKENDS[class_name][0]}")
        return getattr(module, class_name)


def json_schema(schema: dict, all_strings: bool = False) -> dict:
    """A BFCL parameter schema as JSON Schema. Java/JavaScript tasks pass their arguments as
    source strings (`all_strings`), as BFCL itself does."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if all_strings and schema.get("type") not in ("dict", "object"):
                out["type"] = "string"
            elif value in JSON_TYPES:
                out["type"] = JSON_TYPES[value]
            # "any" and unknown types: no constraint
        elif key == "properties":
            out["properties"] = {k: json_schema(v, all_strings) for k, v in value.items()}
        elif key == "items" and not all_strings:
            out["items"] = json_schema(value)
        elif key in ("description", "enum", "default", "required"):
            out[key] = value
    if out.get("type") == "object" and "properties" not in out and schema.get("type") == "dict":
        out["properties"] = {}
    if "required" in out and "properties" in out:
        out["required"] = [r for r in out["required"] if r in out["properties"]]
    if out.get("type") == "string" and "enum" in out:
        out["enum"] = [str(e) for e in out["enum"]]
    if "default" in out and out.get("type") == "string" and not isinstance(out["default"], str):
        out["default"] = str(out["default"])
    return out


def tool_schema(fn: dict, language: str = "python") -> dict:
    """One BFCL function doc as an OpenAI-shape tool with JSON-Schema parameters."""
    description = fn.get("description", "")
    if description.startswith("This tool belongs to the") and "Tool description: " in description:
        description = description.split("Tool description: ", 1)[1]
    parameters = json_schema(fn["parameters"], all_strings=language != "python")
    parameters["type"] = "object"
    parameters.setdefault("properties", {})
    return {"type": "function",
            "function": {"name": fn["name"], "description": description, "parameters": parameters}}


def language_of(category: str) -> str:
    return {"simple_java": "java", "simple_javascript": "javascript"}.get(category, "python")


@dataclass
class SingleTurnTask:
    id: str
    category: str
    question: list[dict]              # the messages of the only turn
    tools: list[dict]
    calls: list[dict] = field(default_factory=list)  # [{"name", "arguments"}], empty: no call


def _pick(values: list) -> tuple[bool, Any]:
    """BFCL lists the acceptable values of an argument; "" means it may be left out."""
    for v in values:
        if v != "" and v is not None:
            return True, v
    return False, None


def single_turn(bfcl: Bfcl, category: str) -> Iterator[SingleTurnTask]:
    answers = bfcl.answers(category) if category != "irrelevance" else {}
    language = language_of(category)
    for row in bfcl.rows(f"BFCL_v4_{category}.json"):
        calls = []
        for call in answers.get(row["id"], []):
            (name, args), = call.items()
            picked = {k: _pick(v) for k, v in args.items()}
            calls.append({"name": name, "arguments": {k: v for k, (ok, v) in picked.items() if ok}})
        yield SingleTurnTask(row["id"], category, row["question"][0],
                             [tool_schema(f, language) for f in row["function"]], calls)


@dataclass
class MultiTurnTask:
    id: str
    category: str
    turns: list[list[dict]]           # user messages per turn
    calls: list[list[str]]            # ground-truth call strings per turn, e.g. "cd(folder='a')"
    classes: list[str]
    config: dict
    excluded: list[str]
    path: list[str]                   # "Class.method" of every ground-truth call

    @property
    def number(self) -> int:
        return int(self.id.rsplit("_", 1)[1])


def multi_turn(bfcl: Bfcl, category: str) -> Iterator[MultiTurnTask]:
    answers = bfcl.answers(category)
    for row in bfcl.rows(f"BFCL_v4_{category}.json"):
        yield MultiTurnTask(row["id"], category, row["question"], answers[row["id"]],
                            row["involved_classes"], row.get("initial_config", {}),
                            row.get("excluded_function", []), row.get("path", []))


def parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """`name(a, k=v)` as (name, positional literals, keyword literals)."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call):
        raise ValueError(f"not a call: {text!r}")
    name = ast.unparse(node.func)
    return (name, [ast.literal_eval(a) for a in node.args],
            {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg})


class MultiTurnRun:
    """A multi-turn task's backends, loaded with its initial state, executing calls for real."""

    def __init__(self, bfcl: Bfcl, task: MultiTurnTask):
        self.methods: dict[str, Any] = {}
        self.docs: dict[str, dict] = {}
        long_context = task.category == "multi_turn_long_context"
        for class_name in task.classes:
            instance = bfcl.backend_class(class_name)()
            if class_name not in STATELESS:
                instance._load_scenario(copy.deepcopy(task.config.get(class_name, {})),
                                        long_context=long_context)
            for doc in bfcl.backend_docs(class_name):
                if doc["name"] in task.excluded:
                    continue
                self.docs[doc["name"]] = doc
                self.methods[doc["name"]] = getattr(instance, doc["name"])

    def arguments(self, text: str) -> tuple[str, dict[str, Any]]:
        """The call as (name, keyword arguments), positionals bound by the method's signature."""
        name, args, kwargs = parse_call(text)
        bound = inspect.signature(self.methods[name]).bind_partial(*args, **kwargs)
        return name, dict(bound.arguments)

    def execute(self, name: str, arguments: dict[str, Any]) -> str:
        """The backend's answer as BFCL renders it: strings as is, dicts as JSON, else str()."""
        try:
            result = self.methods[name](**arguments)
        except Exception as e:  # a backend error is what the model sees, as in BFCL
            return f"Error during execution: {e}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except TypeError:
                return str(result)
        return str(result)
