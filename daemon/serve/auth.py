"""Who may do what: the identity of a gRPC caller, tenants, and the access policy that joins them.

**Identity.** Where mutual TLS is on (``grpc.tls.require_client_cert``) a caller is named by the
subject CN of its client certificate, as gRPC verified it (``x509_common_name`` of the call's
auth context); a certificate without a CN names no one, and its caller is ``anonymous``. Where
mutual TLS is off, the ``x-hlb-identity`` request header names the caller if the operator trusts
it (``auth.trust_header``: a gateway in front of hlb authenticated the caller and sets it); any
other caller is ``anonymous``.

**Tenants.** A task's tenant is the namespace of its id: ``team-a/train-7`` is team-a's; an id
without ``/`` is the policy's ``default_tenant``'s. So every id belongs to exactly one tenant,
decided by the id alone, and a caller allowed only team-b can neither take an id of team-a's
first nor learn whether one exists: the request is refused before the task is looked up.

**The policy file** (``auth.policy_file``, YAML) names what each identity may do::

    default_tenant: default        # the tenant of ids without "<tenant>/"
    identities:
      alice:                       # a certificate CN, or the header's value where trusted
        submit: [team-a]           # Place, PlaceBatch of team-a's tasks
        read: [team-a, team-b]     # GetPlacement, Explain, ScoreDevices, WatchPlacements, GetClusterState
        cells: [pod-a]             # where these grants hold; default every cell ("*")
      "*":                         # every identity, anonymous too
        read: [public]
    kafka:
      topics:                      # the tenants whose task events each topic may carry
        hlb.tasks: [team-a, team-b]

``"*"`` in a list means every tenant or cell. No gRPC call cancels a task: cancellations arrive on
Kafka, where ``kafka.topics`` decides (``cancel`` in the file is an error saying so). A topic not
listed carries every tenant. Without a policy file everything is allowed, as before there was one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import grpc
import structlog
import yaml
from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError, field_validator

from hlb.daemon.config import Settings, yaml_problem
from hlb.daemon.errors import AccessDeniedError, ConfigError
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

ANONYMOUS = "anonymous"
IDENTITY_HEADER = "x-hlb-identity"
ANY = "*"
SEPARATOR = "/"  # between a task id's tenant and the rest
MAX_SHOWN = 128  # characters of an identity quoted in a refusal

Action = Literal["submit", "read"]
Context = grpc.aio.ServicerContext[Any, Any]

Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Tenant = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^/]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Grants(_Strict):
    """What one identity may do: the tenants it may submit and read, in which cells."""

    submit: frozenset[Tenant] = frozenset()
    read: frozenset[Tenant] = frozenset()
    cells: frozenset[Name] = frozenset({ANY})
    cancel: None = None  # only to say why it is refused

    @field_validator("cancel", mode="before")
    @classmethod
    def _no_cancel_rpc(cls, value: object) -> None:
        raise ValueError(
            "no gRPC call cancels a task: cancellations arrive on Kafka, where kafka.topics says which "
            "tenants each topic may carry"
        )

    def allows(self, action: Action, tenant: str, cell: str) -> bool:
        tenants = self.submit if action == "submit" else self.read
        return (ANY in tenants or tenant in tenants) and (ANY in self.cells or cell in self.cells)

    def reads_in(self, cell: str) -> bool:
        return bool(self.read) and (ANY in self.cells or cell in self.cells)


class TopicTenants(_Strict):
    topics: dict[Name, frozenset[Tenant]] = {}


class AccessPolicy(_Strict):
    """The policy file, validated. Pure: every answer follows from the file and the arguments."""

    default_tenant: Tenant = "default"
    identities: dict[Name, Grants] = {}
    kafka: TopicTenants = TopicTenants()

    def tenant_of(self, task_id: str) -> str:
        """The tenant whose namespace ``task_id`` is in: the part before the first ``/``."""
        tenant, separator, _ = task_id.partition(SEPARATOR)
        return tenant if separator and tenant else self.default_tenant

    def allows(self, identity: str, action: Action, tenant: str, cell: str) -> bool:
        return any(g.allows(action, tenant, cell) for g in self._grants(identity))

    def reads_in(self, identity: str, cell: str) -> bool:
        """Whether ``identity`` may read some tenant's tasks in ``cell`` (the cell's summary)."""
        return any(g.reads_in(cell) for g in self._grants(identity))

    def topic_allows(self, topic: str, tenant: str) -> bool:
        tenants = self.kafka.topics.get(topic)
        return tenants is None or ANY in tenants or tenant in tenants

    def _grants(self, identity: str) -> list[Grants]:
        return [g for g in (self.identities.get(identity), self.identities.get(ANY)) if g is not None]


# -- the file ------------------------------------------------------------------------------------


def load_policy(path: Path) -> AccessPolicy:
    """Read and validate the policy file, or raise ``ConfigError`` naming the line and the key."""
    where = f"auth.policy_file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({exc})") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML {yaml_problem(exc)}") from None
    if root is None:
        raise ConfigError(f"{where}: empty; it would refuse every caller (write `identities: {{}}` to mean that)")
    if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a mapping (default_tenant:, identities:, kafka:)")
    _refuse_duplicate_keys(root, where)
    try:
        return AccessPolicy.model_validate(data)
    except ValidationError as exc:
        lines = [f"{where}: {exc.error_count()} invalid value(s)"]
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"]) or "(top level)"
            lines.append(f"  line {_line_of(root, error['loc'])}: {key}: {error['msg']}")
        raise ConfigError("\n".join(lines)) from None


def _refuse_duplicate_keys(node: yaml.Node, where: str) -> None:
    """YAML keeps the last of two equal keys silently; in a policy that would hide a grant."""
    if isinstance(node, yaml.MappingNode):
        seen: set[object] = set()
        for key, value in node.value:
            if key.value in seen:
                raise ConfigError(f"{where}: line {key.start_mark.line + 1}: key {key.value!r} given twice")
            seen.add(key.value)
            _refuse_duplicate_keys(value, where)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, where)


def _line_of(node: yaml.Node, loc: tuple[int | str, ...]) -> int:
    """The line (1-based) of the deepest node of ``loc`` that the file has (a key's, for a key)."""
    line = node.start_mark.line
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if found is None:
                break
            line, node = found[0].start_mark.line, found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line
        else:
            break
    return line + 1


# -- the running daemon's access control --------------------------------------------------------

_NO_POLICY = AccessPolicy()  # names tenants where no policy file does


@dataclass(frozen=True)
class _InForce:
    policy: AccessPolicy | None
    trust_header: bool
    path: Path | None


class Access:
    """Access control as the running daemon applies it: callers named (``caller``), requests and
    task events checked against the policy in force. ``reload`` swaps in new settings and the
    policy file read again, so the API and ingest use the new policy from their next check.

    ``tasks_topic``: where the API records the tasks it accepts, which ingest replays after a
    restart: a submission is refused for a tenant that topic may not carry.
    """

    def __init__(
        self,
        policy: AccessPolicy | None = None,
        *,
        trust_header: bool = False,
        tasks_topic: str = "hlb.tasks",
        path: Path | None = None,
    ) -> None:
        self._in_force = _InForce(policy, trust_header, path)
        self.tasks_topic = tasks_topic

    @classmethod
    def from_settings(cls, settings: Settings) -> Access:
        """Raises ``ConfigError`` for a policy file that does not load."""
        path = settings.auth.policy_file
        policy = load_policy(path) if path is not None else None
        return cls(policy, trust_header=settings.auth.trust_header, tasks_topic=settings.kafka.topics.tasks, path=path)

    @property
    def policy(self) -> AccessPolicy | None:
        return self._in_force.policy

    def reload(self, settings: Settings) -> None:
        """Read the policy file of ``settings`` again; raises ``ConfigError`` and keeps the running
        policy when it does not load."""
        path = settings.auth.policy_file
        policy = load_policy(path) if path is not None else None
        self._in_force = _InForce(policy, settings.auth.trust_header, path)
        self.tasks_topic = settings.kafka.topics.tasks
        self.announce()

    def announce(self) -> None:
        """Say in the log what is in force (at start and after each reload)."""
        state = self._in_force
        if state.policy is None:
            log.warning(
                "authorization off: no auth.policy_file, so every caller may submit and read every tenant's tasks",
                trust_header=state.trust_header,
            )
            return
        log.info(
            "access policy in force",
            policy_file=str(state.path),
            identities=len(state.policy.identities),
            topics=len(state.policy.kafka.topics),
            trust_header=state.trust_header,
        )

    def tenant_of(self, task_id: str) -> str:
        """The tenant of ``task_id`` under the policy in force (without one: ``default`` for an id
        without ``/``)."""
        return (self._in_force.policy or _NO_POLICY).tenant_of(task_id)

    # -- callers -------------------------------------------------------------------------------

    def caller(self, context: Context) -> str:
        """The identity of the caller of ``context`` (``anonymous`` when nothing names it)."""
        state = self._in_force
        if state.policy is None:
            return ANONYMOUS  # nothing to check it against
        name = next(iter(context.auth_context().get("x509_common_name", ())), None)
        if name is not None:
            return name.decode("utf-8", "replace")
        if state.trust_header:
            for key, value in context.invocation_metadata() or ():
                if key == IDENTITY_HEADER and isinstance(value, str) and value:
                    return value
        return ANONYMOUS

    # -- checks (each raises AccessDeniedError naming the action and the tenant) ----------------

    def check_submit(self, caller: str, spec: ev.TaskSpec, cell: str, *, recorded: bool, where: str = "task") -> None:
        """``caller`` may submit ``spec`` in ``cell``: its tenant's tasks, and read those it
        depends on; with ``recorded``, its tenant may be carried by the tasks topic as well."""
        policy = self._in_force.policy
        if policy is None:
            return
        tenant = policy.tenant_of(spec.id)
        self._check(policy, caller, "submit", tenant, cell, where)
        for i, dependency in enumerate(spec.dependencies):
            self._check(
                policy, caller, "read", policy.tenant_of(dependency.task_id), cell, f"{where}.dependencies[{i}]"
            )
        if recorded and not policy.topic_allows(self.tasks_topic, tenant):
            raise AccessDeniedError(
                f"{where}: tasks of tenant {tenant!r} may not be submitted here: the access policy does not "
                f"let topic {self.tasks_topic!r}, where submissions are recorded, carry them (kafka.topics)"
            )

    def check_read(self, caller: str, task_id: str, cell: str, where: str = "task_id") -> None:
        policy = self._in_force.policy
        if policy is not None:
            self._check(policy, caller, "read", policy.tenant_of(task_id), cell, where)

    def check_cell(self, caller: str, cell: str) -> None:
        """``caller`` may read some tenant's tasks in ``cell`` (its summary, its placement stream)."""
        policy = self._in_force.policy
        if policy is not None and not policy.reads_in(caller, cell):
            raise AccessDeniedError(f"identity {_shown(caller)} may not read any tenant's tasks in cell {cell!r}")

    def may_read_cell(self, caller: str, cell: str) -> bool:
        """Whether ``check_cell`` lets ``caller`` read ``cell``'s summary."""
        policy = self._in_force.policy
        return policy is None or policy.reads_in(caller, cell)

    def may_read(self, caller: str, task_id: str, cell: str) -> bool:
        policy = self._in_force.policy
        return policy is None or policy.allows(caller, "read", policy.tenant_of(task_id), cell)

    def task_event_refusal(self, topic: str, event: ev.TaskEvent) -> str | None:
        """Why the task event may not come from ``topic`` (its task's tenant is not allowed there),
        or None. The ingest step that refuses it with reason ``tenant_not_allowed``."""
        policy = self._in_force.policy
        if policy is None:
            return None
        task_id = task_of(event)
        tenant = policy.tenant_of(task_id)
        if policy.topic_allows(topic, tenant):
            return None
        return f"task {task_id!r} is of tenant {tenant!r}, which topic {topic!r} may not carry (kafka.topics)"

    @staticmethod
    def _check(policy: AccessPolicy, caller: str, action: Action, tenant: str, cell: str, where: str) -> None:
        if not policy.allows(caller, action, tenant, cell):
            raise AccessDeniedError(
                f"{where}: identity {_shown(caller)} may not {action} tasks of tenant {tenant!r} in cell {cell!r}"
            )


def task_of(event: ev.TaskEvent) -> str:
    """The id of the task a task event is about (a submitted spec's id, or its payload's task id)."""
    kind = event.WhichOneof("payload")
    if kind is None:
        return ""
    payload = getattr(event, kind)
    field = "task_id" if "task_id" in payload.DESCRIPTOR.fields_by_name else "id"
    task_id: str = getattr(payload, field)
    return task_id


def _shown(identity: str) -> str:
    return repr(identity if len(identity) <= MAX_SHOWN else identity[:MAX_SHOWN] + "...")
