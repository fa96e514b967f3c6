"""Pydantic models of the OpenAI chat/completions request bodies and vLLM's /tokenize, /detokenize.

app.py validates each body with these (unknown fields ignored, known fields with bad values
refused with 400); request_mapping.py turns a validated body into the workers' proto messages.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Enough for every OpenAI limit we mirror; the model worker checks the rest against its vocab.
MAX_TOP_LOGPROBS = 20
# OpenAI's bound on n; the model worker refuses more samples than its --max-best-of and
# --max-num-seqs let it run at once (a 400 naming n or best_of).
MAX_N = 128
# Token ids, counts and top_k travel as int32 on the wire (vLLM refuses what does not fit too).
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
# AddRequest.length_penalty's bound (model_worker.proto), refused here with a 400 naming it.
MAX_ABS_LENGTH_PENALTY = 10.0
# JSON's "\ud800" escapes parse to lone UTF-16 surrogates, which are not Unicode text: no
# tokenizer or protobuf string takes them.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _Lenient(BaseModel):
    # The OpenAI SDK sends fields we do not know (metadata, store, ...): ignore them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN failed bounds as "<= 2"

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI documents its optional fields as "X or null", and clients forward None for
        # what they leave unset: a null takes the field's default, as vLLM's Optional fields do.
        if isinstance(data, dict) and None in data.values():
            defaulted = _defaulted_fields(cls)
            data = {key: value for key, value in data.items() if value is not None or key not in defaulted}
        return data


@functools.cache
def _defaulted_fields(model: type[BaseModel]) -> frozenset[str]:
    """The JSON names of a model's optional fields that do not take None themselves (where a
    field does, as completions' max_tokens, null keeps its own meaning)."""
    return frozenset(field.alias or name for name, field in model.model_fields.items()
                     if not field.is_required() and type(None) not in typing.get_args(field.annotation))


def reject_lone_surrogates(data: Any) -> None:
    """Raises ValueError naming the first string (key or value, at any depth) that holds a lone
    surrogate."""
    pending = [data]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise ValueError(f"{value[:40]!r} holds a lone UTF-16 surrogate, which is not valid Unicode text")
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(v for v in value if v.__class__ is not int)


class ParamError(ValueError):
    """A check across fields (a model validator, whose errors pydantic locates nowhere) that names
    the field at fault: the 400's `param`, as OpenAI's errors give it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_LEGACY_FUNCTIONS = "the deprecated functions / function_call are not supported: send tools and tool_choice"
# Fields of OpenAI's or vLLM's API this server does not implement and that would change the answer
# if it did: refused by name (with what to do instead), where the bookkeeping ones it does not need
# (store, metadata, user, service_tier...) are ignored. The message for each; the refusal applies
# when the value asks for something (_asks_for_it: not null, false, empty or neutral).
_UNSERVED_FIELDS = {
    "functions": _LEGACY_FUNCTIONS,
    "function_call": _LEGACY_FUNCTIONS,
    "audio": "audio output is not supported: this model answers in text",
    # vLLM's extensions this server does not have.
    "thinking_token_budget": "thinking_token_budget is not supported: max_tokens bounds the thinking and the answer "
                             "together",
    "logprob_token_ids": "logprob_token_ids is not supported: use top_logprobs",
    "logits_processors": "logits_processors are not supported by this server",
    "repetition_detection": "repetition_detection is not supported: repetition_penalty, frequency_penalty or DRY "
                            "(dry_multiplier) discourage repeats",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "priority": "priority scheduling is not supported: every request has priority 0",
    "kv_transfer_params": "kv_transfer_params is not supported: this server does not transfer KV caches",
    "ec_transfer_params": "ec_transfer_params is not supported: this server does not transfer encoder caches",
    "vllm_xargs": "vllm_xargs is not supported: this server runs no custom extensions",
}
# An unserved field's values that ask for nothing beyond null, false and empty: priority 0 is every
# request's, and -1 is vLLM's "unlimited" thinking budget (0 is a budget: no thinking).
_UNSERVED_NEUTRAL_VALUES: dict[str, tuple[int, ...]] = {"priority": (0,), "thinking_token_budget": (-1,)}


def _asks_for_it(name: str, value: Any) -> bool:
    """Whether an unserved field's value asks for something (the field is then refused)."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return False
    return value not in _UNSERVED_NEUTRAL_VALUES.get(name, ())


class _TopLevel(_Lenient):
    """A whole request body: its strings are checked once, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_text_only(cls, data: Any) -> Any:
        reject_lone_surrogates(data)
        return data


class StreamOptions(_Lenient):
    # True unless sent as false, as vLLM's and SGLang's: a client that sends stream_options at all
    # ({"continuous_usage_stats": true}, say) gets usage.
    include_usage: bool = True
    # vLLM's extension: every chunk also carries the usage so far (needs include_usage), so a
    # client counts tokens per chunk exactly instead of re-tokenizing text.
    continuous_usage_stats: bool = False


class TextContentPart(_Lenient):
    # "refusal": an assistant's refusal replayed (OpenAI's part for it), read as its text.
    type: Literal["text", "refusal"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _refusal_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "refusal":
            return {**data, "text": data.get("refusal")}
        return data


class ChatMessage(_Lenient):
    # OpenAI's system, developer, user, assistant, tool and the deprecated function (the answer to
    # a legacy function_call), or any other role the model's template knows (Llama 3's ipython),
    # as vLLM takes them.
    role: str = Field(min_length=1)
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # Replayed tool conversations: the assistant's calls and the tool's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # A replayed assistant turn's thinking (what this gateway returns as `reasoning`, and its older
    # name): templates of interleaved thinking (Qwen3's) show it for the turns after the last query.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # Checked before the content's union of forms, whose errors would not say what is wrong.
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "refusal"):
                raise ParamError("messages", f"content parts of type {kind!r} are not supported: this model "
                                             "takes text only")
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # One line per text part, as vLLM joins them for templates that take string content.
        return "\n".join(part.text for part in self.content)


class JsonSchemaFormat(_Lenient):
    # Required, as OpenAI and vLLM require it; any string, as vLLM takes it (OpenAI's own pattern,
    # letters, digits, _ and - up to 64, refused names vLLM's clients send: review 105).
    name: str
    description: str | None = None
    # OpenAI's field is `schema`, which shadows BaseModel.schema: hence the alias.
    schema_: dict[str, Any] = Field(alias="schema", default_factory=dict)
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("response_format", "response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` (which replaced its guided_* fields in v0.12): one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options this server cannot honour: refused when set, rather than silently ignored.
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        for option in ("structural_tag", "whitespace_pattern", "disable_any_whitespace"):
            if getattr(self, option):
                raise ParamError("structured_outputs", f"structured_outputs.{option} is not supported")
        if self.choice is not None and not self.choice:
            raise ParamError("structured_outputs", "structured_outputs.choice must list at least one choice")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ParamError("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, "
                                                   f"grammar, json_object (got {', '.join(kinds) or 'none'})")
        return self

    def kinds(self) -> list[str]:
        return [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                         ("grammar", self.grammar), ("json_object", self.json_object or None))
                if value is not None]


class _GenerationRequest(_TopLevel):
    """Parameters chat completions and completions share (OpenAI's, then vLLM/SGLang extensions)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, message in _UNSERVED_FIELDS.items():
                if _asks_for_it(name, data.get(name)) and name not in cls.model_fields:
                    raise ParamError(name, message)
            modalities = data.get("modalities")
            if isinstance(modalities, list) and any(m != "text" for m in modalities):
                raise ParamError("modalities", "only text output is supported (modalities: [\"text\"])")
        return data

    model: str | None = None  # None: the model served (vLLM's; OpenAI requires it)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # int64, as vLLM bounds it: a larger one would wrap into the uint64 the sampler takes.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a JSON object key, so a string) -> bias added to its logit.
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's sampling extensions.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    # None where unset: the model's generation_config.json may have a default (ModelInfo).
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int32] | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    use_beam_search: bool = False
    length_penalty: float | None = Field(default=None, ge=-MAX_ABS_LENGTH_PENALTY, le=MAX_ABS_LENGTH_PENALTY)
    # Diverse beam search (transformers / OpenVINO): beams penalise tokens earlier beams chose.
    diversity_penalty: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    # Structured output: vLLM's guided_* fields and SGLang's regex / ebnf.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    # vLLM's: which end truncate_prompt_tokens cuts; "right" keeps the first tokens (default "left").
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprob tokens as "token_id:N" rather than their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's: the output's token ids beside its text (and the prompt's ids), for RL and tracing.
    return_token_ids: bool = False
    # vLLM's: the prefix cache shares a prompt's blocks only with requests of the same salt, so
    # one tenant cannot learn another's prompts from cached_tokens or from the first token's time.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _check_shared(self) -> _GenerationRequest:
        if self.truncate_prompt_tokens == 0:
            raise ParamError("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1, or -1 for the model's "
                                                       "context length")
        if any(s == "" for s in self.stop_strings()):
            raise ParamError("stop", "stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ParamError("stop_token_ids", "stop_token_ids must be >= 0")
        if any(t < 0 for t in self.allowed_token_ids or []):
            raise ParamError("allowed_token_ids", "allowed_token_ids must be >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty (leave it out to allow every token)")
        if any(not w.strip() for w in self.bad_words or []):
            raise ParamError("bad_words", "bad_words must not contain empty (or only whitespace) strings")
        for key, bias in (self.logit_bias or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit() and int(key) <= INT32_MAX):
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, not {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], not {bias}")
        if self.best_of is not None and self.best_of < self.n:
            raise ParamError("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.guided_choice is not None and not self.guided_choice:
            raise ParamError("guided_choice", "guided_choice must list at least one choice")
        constraints = self.output_constraints()
        if len(constraints) > 1:
            raise ParamError(constraints[1], f"only one output constraint at a time, got {', '.join(constraints)}")
        options = self.stream_options  # an empty object without stream is let through, as vLLM does
        if options is not None and not self.stream and options.model_fields_set:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available with stream=true")  # as in vLLM
        limit = self.completion_token_limit()
        if limit is not None and self.min_tokens > limit:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        return self

    def output_constraints(self) -> list[str]:
        """The fields that constrain the output's form (structured output) this request sets."""
        constraints = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                         "regex", "ebnf", "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            constraints.append("response_format")
        return constraints

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def completion_token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


# apply_chat_template's own arguments: chat_template_kwargs may not set them (vLLM refuses them too).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _ChatTemplateFields(BaseModel):
    """vLLM's chat template controls: end the prompt with the assistant's turn opened
    (add_generation_prompt, the default), or leave the last (assistant) message open for the model
    to continue (continue_final_message: prefill); chat_template_kwargs are extra template
    variables (e.g. Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for templates of retrieval-augmented models (Command R's, Granite's),
    # given to the template as HF's apply_chat_template takes them (a list of {"title", "text"}...).
    documents: list[dict[str, Any]] | None = None
    # OpenAI's; for open models a template variable, as vLLM passes it (gpt-oss's template reads
    # it), and "none" turns thinking off in templates that read enable_thinking (Qwen3's).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def _applies_chat_template(self) -> bool:
        return True

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables: chat_template_kwargs, and reasoning_effort with the
        enable_thinking it implies unless chat_template_kwargs sets that itself (vLLM's rule)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _refuse_request_template(cls, data: Any) -> Any:
        # On /tokenize too (its count is for the template the request would run under), unless it
        # counts a plain prompt, which no template touches (vLLM ignores the fields there).
        counts_a_prompt = "prompt" in cls.model_fields and isinstance(data, dict) and data.get("prompt") is not None
        if isinstance(data, dict) and data.get("chat_template") and not counts_a_prompt:
            raise ParamError("chat_template", "a chat template in the request is not supported (vLLM refuses "
                             "one without --trust-request-chat-template): the model's own template is used")
        return data

    @model_validator(mode="after")
    def _check_template_fields(self) -> _ChatTemplateFields:
        if not self._applies_chat_template():
            return self
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message",
                             "continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt to false to continue the last message)")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # A JSON schema of the arguments object; none: any object.
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> ToolDefinition:
        # A call's arguments are a JSON object (OpenAI's "parameters": a JSON Schema object).
        kind = (self.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise ParamError("tools", f"function {self.function.name!r}: parameters must describe an object, "
                                      f"not type {kind!r}")
        return self


def template_tools_of(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates get them: every field, unset ones null (vLLM's), so a template that
    reads `parameters` or `description` finds the key."""
    return [t.model_dump() for t in tools] if tools else None


def arguments_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The schema a call's arguments decode against: `parameters` as sent, typed an object where
    it names no type (ToolDefinition already refuses any other type), else any JSON value would
    match and a client's json.loads(arguments) could get a list or a bool; a function without
    parameters takes none (OpenAI's empty parameter list), so its arguments are {}; and, as vLLM's
    default backend (xgrammar, strict) decodes them, no property the schema does not list."""
    parameters = function.parameters or {"properties": {}}
    return closed_objects(parameters if "type" in parameters else {"type": "object", **parameters})


# Where the "required" call list keeps tool i's schema: under the root's $defs, so its own
# pointers ("#", "#/$defs/...", "#/definitions/...", "#/properties/...") can be re-rooted there.
_TOOL_DEF = "tokenwire_tool_{}"
# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_SCHEMA_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


# Keywords whose values map names to schemas (not schemas themselves: a property named
# "properties" is not a keyword).
_SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_objects(schema: Any) -> Any:
    """schema with `additionalProperties: false` on each object schema that lists properties (or
    patternProperties) and says nothing of others: vLLM's disable_additional_properties rule, and
    what its default backend (xgrammar, strict) decodes. Plain JSON Schema lets such an object take
    any other key, and llguidance follows it: a forced tool call wandered into keys nobody declared
    and ran to max_tokens (review 103). A schema that composes objects (allOf, or a $ref beside
    properties) is left as sent: each part closed would refuse the other parts' keys, and a base
    object plus its own properties became unsatisfiable (review 105). An allOf of one schema and
    nothing beside it (a $ref wrapped to carry a description) composes nothing and is closed."""
    return schema if _composes_objects(schema) else _closed(schema)


def _composes_objects(schema: Any) -> bool:
    """Whether any object schema in it is made of parts: an allOf of two or more, or beside
    properties of its own, or a $ref beside properties. Walked with a stack of its own, as deep
    as json.loads reads (recursion cost frames a level: a 200-deep tool schema was a 500)."""
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            own = "properties" in value or "patternProperties" in value
            parts = value.get("allOf")
            if (isinstance(parts, list) and (len(parts) > 1 or own)) or ("$ref" in value and own):
                return True
            for key, sub in value.items():
                if key in _SCHEMA_MAP_KEYWORDS and isinstance(sub, dict):
                    pending.extend(sub.values())
                elif key not in _SCHEMA_DATA_KEYWORDS:
                    pending.append(sub)
    return False


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_DATA_KEYWORDS:
            closed[key] = value
        elif key in _SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            closed[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            closed[key] = _closed(value)
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def reroot_schema(schema: Any, root: str) -> Any:
    """schema with every local $ref ("#..." ) pointing into it made to point at root + the same
    path, for the schema moved from the document root to `root` (a JSON pointer fragment)."""
    if isinstance(schema, list):
        return [reroot_schema(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            moved[key] = root + value[1:]
        elif key in _SCHEMA_DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = reroot_schema(value, root)
    return moved


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_ChatTemplateFields, _GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: at most one call ("required" decodes a list of one).
    parallel_tool_calls: bool = True
    # vLLM's extension: the answer starts with the last message's text where that message is the
    # answer's own role (an assistant prefill continued with continue_final_message).
    echo: bool = False
    # vLLM's: false would leave the reasoning out of the answer; refused (below), not ignored.
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs set to true")
        if not self.include_reasoning:
            raise ParamError("include_reasoning", "include_reasoning false is not supported: with a --reasoning-parser "
                                                  "the thinking comes back as `reasoning`, apart from `content`")
        # OpenAI's and vLLM's checks: a tool list is not empty, and tool_choice other than "none"
        # comes with tools.
        if self.tools is not None and not self.tools:
            raise ParamError("tools", "tools must not be an empty array: send at least one tool, or leave it out")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools: send the tools it may call")
        # Function calling as vLLM does it: a forced call ("required", or a named function) is
        # structured output, the arguments decoded against the tools' schemas; "none" runs without
        # them; "auto" (the default with tools) needs the gateway's --tool-call-parser, which app.py
        # checks, to find calls in the model's own syntax.
        if self.forces_tool_call():
            if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
                raise ParamError("tool_choice", f"tool_choice names the function {self.tool_choice.function.name!r}, "
                                                "which is not among the tools")
            if self.output_constraints():
                raise ParamError("tool_choice", "a forced tool call is an output constraint of its own; "
                                                "not with response_format or guided_* fields")
            if self.use_beam_search:
                raise ParamError("tool_choice", "a forced tool call is structured output, which beam search "
                                                "cannot apply")
            try:
                self.tool_call_schema()  # refuses tools whose $defs clash, here rather than mid-request
            except RecursionError:  # nested past Python's stack: a 400, not a 500 (review 107)
                raise ParamError("tools", "a tool's JSON schema is nested too deeply") from None
        return self

    def lets_model_choose_tool(self) -> bool:
        """tool_choice "auto", sent or the default with tools: the model calls a tool or answers."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def named_tool(self) -> ToolDefinition | None:
        """The tool a named tool_choice picks (None where it names no tool, or names none)."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((t for t in self.tools or () if t.function.name == self.tool_choice.function.name), None)

    def tool_call_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool call's output is decoded against (vLLM's): a named
        function's arguments object; for "required", a non-empty array of {name, parameters}
        objects, one of the tools each. None when no call is forced."""
        named = self.named_tool()
        if named is not None:
            return arguments_schema(named.function)
        if self.tool_choice != "required":
            return None
        # Each tool's schema whole under the root's $defs, its pointers re-rooted there: nested in
        # the list as sent, "#" would mean the list and "#/definitions/..." would point nowhere.
        tools = self.tools or ()
        defs = {_TOOL_DEF.format(i): reroot_schema(arguments_schema(t.function), f"#/$defs/{_TOOL_DEF.format(i)}")
                for i, t in enumerate(tools)}
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": {"$ref": f"#/$defs/{_TOOL_DEF.format(i)}"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema

    def template_tools(self, exclude_when_none: bool = False) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (for templates that describe them to the
        model); with tool_choice "none" too (OpenAI's and vLLM's default: the model knows them and
        calls none), unless exclude_when_none (--exclude-tools-when-tool-choice-none)."""
        if exclude_when_none and self.tool_choice == "none":
            return None
        return template_tools_of(self.tools)

    def echo_text(self) -> str:
        """The text echo puts before the answer: the last message's, where it is the assistant's
        (vLLM's rule; the answer is always the assistant's here), else none."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def completion_token_limit(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# The most prompts one completions batch may hold, checked before anything else of the body: far
# more than the model workers queue at once (app.py's _check_batch_fits refuses past that: 1056 a
# replica by default), but a bound on what validation costs the event loop (a million [[5]] took
# 2.3 s there, every stream stalled, review 87).
MAX_BATCH_PROMPTS = 16384


class CompletionRequest(_GenerationRequest):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[Int32] | list[list[Int32]]
    # 0 only with echo: the prompt scored, nothing generated (vLLM's echo without generation, what
    # lm-evaluation-harness sends for loglikelihoods).
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: false for a text prompt that already holds them (a chat template rendered by the
    # client), where the tokenizer would add a second BOS.
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _batch_within_bound(cls, data: Any) -> Any:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and len(prompt) > MAX_BATCH_PROMPTS and not isinstance(prompt[0], int):
            raise ParamError("prompt", f"a batch may hold at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}")
        return data

    @model_validator(mode="after")
    def _check_completion_fields(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise ParamError("prompt", "prompt must not be empty")
            # Each union member is a list of one kind, so its first item tells which (a scan of
            # every item cost 0.3 s for a prompt of 2 million ids).
            if isinstance(self.prompt[0], list) and not all(self.prompt):
                raise ParamError("prompt", "a token-id prompt must not be empty")
        if self.suffix:
            raise ParamError("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt)")
        if self.use_beam_search and self.echo and self.logprobs is not None:
            # Echo's logprobs are the prompt's, which beam search does not compute (the model
            # worker refused it as prompt_logprobs, a field this body does not have).
            raise ParamError("echo", "beam search does not return the prompt's logprobs: echo with logprobs is "
                                     "not supported with use_beam_search")
        return self

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, no generated token."""
        return self.echo and self.max_tokens == 0

    def completion_token_limit(self) -> int | None:
        # Scoring runs one token, which the answer leaves out (app.py's prompt_only).
        return 1 if self.scores_prompt_only else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a text to tokenize or token ids as given."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):  # one kind of item a list (_check_completion_fields)
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TokenizeRequest(_ChatTemplateFields, _TopLevel):
    """vLLM's /tokenize body: either a prompt or chat messages (with the chat template's controls)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # With messages: the tools the chat template shows, so the count is the chat prompt's (vLLM's).
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt" if self.prompt is not None else "messages", "send exactly one of prompt or messages")
        return self

    def _applies_chat_template(self) -> bool:
        # A prompt ignores the template fields, as vLLM's TokenizeCompletionRequest (which has none).
        return self.messages is not None


class DetokenizeRequest(_TopLevel):
    model: str | None = None
    tokens: list[Int32]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
