"""What a failed Ray task says: the messages of ``gpu_map(executor="ray")``'s ``WorkerError``s.

``_ray`` runs the tasks; this module words their faults, in the local
executor's words where it has them (``_mapfaults``), and tells which of them
are Ray's own (its cancellation, a failed upstream task). A task answers
(``("ok", result)``, or a fault as a tuple, see ``_ray._run``), or Ray
raises for it:

- ``RayTaskError`` whose cause is ``RaySystemError``: an argument could not be
  rebuilt in the worker (Ray's "At least one of the input arguments for this
  task could not be computed"). ``fn`` is fetched by the task itself, so the
  one argument that can fail is an item that Ray rebuilt (a packed one the
  task unpacks itself, and answers for): said as the local executor says it.
- ``RayTaskError`` with any other cause that is not one of Ray's: Ray's code
  after the task returned failed, serializing the result. Where Ray's
  traceback also passes through its serializer, in devicekit's task (not in
  the task that made an ``ObjectRef`` item), that is retold in the local
  executor's words ("the result ... cannot be sent back").
- Any other Ray error is shown as Ray writes it, without its colour codes.

Before any task, ``check_address`` refuses a ``RAY_ADDRESS`` that ``ray.init()``
cannot use or that nothing answers at, in gpu_map's words.
"""

from __future__ import annotations

import re
import socket
import sys
from typing import Any

from ._format import first_line
from ._mapfaults import fn_raised, item_fault, show_item
from ._worker import _summary

__all__ = [
    "TASK_NAME",
    "answer_failed",
    "check_address",
    "exit_what",
    "loading_error",
    "plain_text",
    "ray_cancelling",
    "ray_failed",
    "result_not_rebuilt",
    "this_ray",
    "unserializable_reason",
    "worker_died",
]

TASK_NAME = "devicekit.gpu_map"
"""The name of gpu_map's Ray tasks: Ray's text reads ``ray::devicekit.gpu_map()``.

Not ``_run``, Ray's name for them from their function: a user's task can have
that name too (an item's upstream task), and its failure read as ours.
"""

_CANCEL_API = "2.54"  # the first Ray with ray.get_runtime_context().is_canceled()
_NOT_AN_EXCEPTION = "(SystemExit and KeyboardInterrupt are not Exceptions)"


def answer_failed(index: int, item: object, answer: tuple[Any, ...]) -> str:
    """The message for a task that answered a fault rather than ``("ok", result)``."""
    kind, where = answer[0], answer[1]
    shown = f"item {index} ({show_item(item)})"
    if kind == "raised":
        return fn_raised(index, item, where, answer[2])
    if kind == "exited":  # fn raised a BaseException that is not an Exception
        return item_fault(kind, index, item, where, (kind, index, answer[2], answer[3]))
    if kind == "interrupted":  # KeyboardInterrupt, on a Ray that cannot say whose
        return (
            f"gpu_map: {shown} stopped on KeyboardInterrupt in {where}: fn raised it, or Ray "
            "cancelled the task (ray.cancel() without force, or a cancel of the task that "
            f"called gpu_map, raises KeyboardInterrupt in it), and {answer[2]} cannot tell "
            f"which (Ray {_CANCEL_API} and later can). If fn raised it: fn must return a "
            f"result, or raise an Exception to fail its item {_NOT_AN_EXCEPTION}. The "
            f"worker's traceback:\n{answer[3]}"
        )
    if kind == "item_failed":  # the task could not unpickle the item
        return item_fault(kind, index, item, where, (kind, index, answer[2], answer[3]))
    if kind == "fn_failed":
        return (
            f"gpu_map: fn could not be rebuilt in {where}, for {shown}: {answer[2]}. Ray "
            "sends fn by reference to its module where it can: every node must be able to "
            "import that module and what fn uses (install them there, or pass them with a "
            "Ray runtime_env, e.g. ray.init(runtime_env={'py_modules': [module]})), and "
            f"rebuilding fn must not exit. The worker's traceback:\n{answer[3]}"
        )
    if kind == "unsendable":  # pickling the result raised a BaseException
        return (
            f"gpu_map: the result of {shown} cannot be sent back from {where}: pickling it "
            f"{_did(answer[2])} {_NOT_AN_EXCEPTION}; it was not retried: that is code in the "
            "result (a __reduce__ or __getstate__) asking to exit, or a bug there. Return "
            "picklable data: numbers, strings, tensors, or containers of them. The worker's "
            f"traceback:\n{answer[3]}"
        )
    _, where, summary, remote_traceback = answer  # "task_failed"
    return (
        f"gpu_map: the Ray task for {shown} failed in {where}, outside fn (in devicekit's "
        f"code around it): {summary}. The task's traceback:\n{remote_traceback}"
    )


_CONNECT_TIMEOUT = 10.0  # seconds to wait for RAY_ADDRESS's port to accept a connection


def check_address(address: str) -> None:
    """Refuse a ``RAY_ADDRESS`` that ``ray.init()`` cannot use, or that nothing answers at.

    ``ray.init()`` reads ``RAY_ADDRESS`` as a cluster's GCS address
    (``host:port``, ``[::1]:6379``), a Ray Client address
    (``ray://host:port``), ``auto`` or ``local``; any other ``scheme://`` names
    a module that provides a client. An ``http://`` or ``https://`` address (a
    dashboard's, which ``ray job submit`` takes) it refuses: that is said here,
    in gpu_map's words (the scheme was taken for the host name before, and the
    error blamed DNS).

    ``ray.init()`` retries an address that does not answer for many minutes
    (Ray 2.60 took 14 minutes to give up on a port nothing listened on),
    printing warnings: a stale ``RAY_ADDRESS`` looks like a hang. One TCP
    connection, bounded, tells a cluster that is down at once. Only the
    ``host:port`` and ``ray://host:port`` forms are checked; the others are
    Ray's to read.
    """
    scheme, has_scheme, rest = address.strip().partition("://")
    if has_scheme and scheme.lower() in ("http", "https"):
        raise ValueError(
            f"RAY_ADDRESS={address!r} is an HTTP address (a Ray dashboard's, which `ray job "
            "submit` uses), and ray.init() cannot connect to a cluster there. Set RAY_ADDRESS "
            "to the cluster's GCS address (head-node:6379) or its Ray Client address "
            "(ray://head-node:10001), or unset it to let gpu_map start a local Ray for the call."
        )
    if has_scheme and scheme != "ray":
        return  # Ray imports the module the scheme names, for its client
    target = (rest if has_scheme else scheme).rstrip("/")
    if not has_scheme and ":" not in target and target.lower() not in ("auto", "local"):
        # Ray's own words were "ValueError: Invalid address format: localhost".
        raise ValueError(
            f"RAY_ADDRESS={address!r} has no port: ray.init() reads it as host:port, the "
            f"cluster's GCS address. Set RAY_ADDRESS={target or 'head-node'}:6379 (6379 is "
            "`ray start --head`'s default), 'auto' for the cluster started on this machine, "
            "or unset it to let gpu_map start a local Ray for the call."
        )
    host, _, port = target.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")  # [::1]:6379
    host = host[1:-1] if bracketed else host
    if not host or (":" in host and not bracketed) or not (port.isascii() and port.isdigit()):
        return  # auto, local, or a form Ray refuses itself, at once
    try:
        with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT):
            pass
    except OSError as error:
        raise ConnectionError(
            f"RAY_ADDRESS={address!r} names a Ray cluster that does not answer: connecting to "
            f"{host}:{port} failed ({error}). Start the cluster (ray start --head), correct "
            "RAY_ADDRESS, or unset it to let gpu_map start a local Ray for the call."
        ) from None


def exit_what(error: BaseException) -> str:
    """``"sys.exit(3)"`` for a ``SystemExit``, else ``"KeyboardInterrupt"`` and the like."""
    return f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else _summary(error)


def loading_error(error: BaseException) -> str:
    """Why fn could not be rebuilt: ``"ModuleNotFoundError: No module named 'mine'"``."""
    if isinstance(error, SystemExit):
        return f"rebuilding it called sys.exit({error.code!r})"
    remote_traceback = getattr(error, "traceback_str", None)  # a RaySystemError's
    if isinstance(remote_traceback, str) and remote_traceback.strip():
        return remote_traceback.strip().splitlines()[-1]
    return _summary(error)


def ray_cancelling() -> bool | None:
    """Whether Ray is cancelling this task (a ``ray.cancel`` without ``force``), None if unknown.

    Ray cancels a running task by raising ``KeyboardInterrupt`` in it, which
    reads as fn's own. Its runtime context says which (``is_canceled()``,
    True from the cancellation on): Ray 2.54 and later have it (added by
    ray-project/ray#58914), Ray 2.53 and before (down to our floor, 2.9) do
    not. Outside a Ray worker (no Ray, or ``is_canceled()`` raising
    ``RuntimeError``) nothing can be Ray's cancellation.
    """
    try:
        import ray  # noqa: PLC0415 - in a Ray worker, imported already

        context = ray.get_runtime_context()
    except ImportError:
        return False
    is_canceled = getattr(context, "is_canceled", None)
    if is_canceled is None:
        return None  # an older Ray: it cannot tell
    try:
        return bool(is_canceled())
    except RuntimeError:  # not a task of a Ray worker
        return False


def this_ray() -> str:
    """``"Ray 2.53.0"``: this Ray, as a message names it."""
    version = getattr(sys.modules.get("ray"), "__version__", None)
    return f"Ray {version}" if isinstance(version, str) else "this Ray"


def _did(what: str) -> str:
    """``"called sys.exit(3)"``, ``"raised KeyboardInterrupt"``."""
    return f"called {what}" if what.startswith("sys.exit(") else f"raised {what}"


def result_not_rebuilt(index: int, item: object, what: str) -> str:
    """The message for a result that came back but raised a BaseException as it was rebuilt."""
    return (
        f"gpu_map: the result of item {index} ({show_item(item)}) came back from its Ray "
        f"task, but rebuilding it here {_did(what)} {_NOT_AN_EXCEPTION}; it was not retried: "
        "that is code in the result (a __reduce__ or __setstate__) asking to exit, or a bug "
        "there. Return picklable data: numbers, strings, tensors, or containers of them."
    )


def ray_failed(
    ray: Any,
    error: BaseException,
    index: int,
    item: object,
    retries: int | None = None,
    *,
    cpu_task: bool = False,
) -> str:
    """The message for a task that Ray failed: its item, its result, or the task itself.

    ``retries``: the task's ``max_retries`` (None: unknown), said when its worker died.
    ``cpu_task``: a CPU task, named "(the CPU)" as the task names itself (`_raytask.where`).
    """
    node = _NODE.search(plain_text(str(error)))
    where = f"a Ray task on {node.group(1)}" if node else "a Ray task"
    if cpu_task:
        where += " (the CPU)"
    crashed = getattr(ray.exceptions, "WorkerCrashedError", None)
    if isinstance(crashed, type) and isinstance(error, crashed):
        return worker_died(index, item, retries, plain_text(str(error)))
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(
        cause, ray.exceptions.RaySystemError
    ):
        summary, remote_traceback = _system_error(cause)
        return item_fault(
            "item_failed", index, item, where, ("item_failed", index, summary, remote_traceback)
        )
    cause = _unsendable_result(ray, error)
    if cause is not None:
        # The error is also an instance of the cause's class, which hides Ray's ip
        # attribute; its message starts "ray::devicekit.gpu_map() (pid=1234, ip=10.0.0.3)".
        reason = ("unpicklable", index, plain_text(f"{type(cause).__name__}: {cause}"))
        return item_fault("unpicklable", index, item, where, reason)
    if isinstance(error, ray.exceptions.RaySystemError) and not isinstance(
        error, ray.exceptions.RayTaskError
    ):  # ray.get could not rebuild the result here
        summary, _ = _system_error(error)
        return (
            f"gpu_map: the result of item {index} ({show_item(item)}) came back from its Ray "
            f"task, but cannot be rebuilt here: {summary}. Return data that this process can "
            "rebuild: numbers, strings, tensors, or containers of them (of classes that this "
            "process can import too)."
        )
    text = plain_text(str(error))
    return f"gpu_map: the Ray task for item {index} ({show_item(item)}) failed: {text}"


def worker_died(index: int, item: object, retries: int | None, said: str) -> str:
    """The message for an item whose Ray worker died, each time Ray ran its task.

    Ray runs such a task again, up to its ``max_retries`` times: ``fn`` may have
    run that many times, and its side effects repeated (Ray 2.60 took 7.6 s and
    four runs to say only "The worker died unexpectedly"). Ray's error carries no
    exit code or signal; its raylet's lines and worker logs do.

    Examples:
        >>> print(worker_died(1, 1, 3, "The worker died unexpectedly.")[:117])
        gpu_map: the Ray task for item 1 (1) failed: its worker died; Ray ran the task up to \
4 times (max_retries=3: Ray runs
    """
    shown = f"item {index} ({show_item(item)})"
    if retries is None or retries < 0:
        runs = (
            "Ray runs a task whose worker dies again, up to its max_retries times, so fn "
            "may have run more than once on this item, and its side effects (files written, "
            "messages sent) may have repeated"
        )
    elif retries == 0:
        runs = "Ray did not run the task again (max_retries=0)"
    else:
        runs = (
            f"Ray ran the task up to {retries + 1} times (max_retries={retries}: Ray runs "
            f"a task whose worker dies again), so fn may have run {retries + 1} times on this "
            "item, and its side effects (files written, messages sent) may have repeated"
        )
    return (
        f"gpu_map: the Ray task for {shown} failed: its worker died; {runs}. Something "
        "ended the worker's "
        "process while it ran: os._exit() in fn, a signal (SIGKILL from the out-of-memory "
        "killer), or a crash in native code. Ray's error does not say which, nor the exit "
        "code: the raylet's log lines (printed above, by default) and the "
        "python-core-worker-*.log files do. Make fn "
        "return, or raise an Exception, instead of ending its process; set "
        f"RAY_TASK_MAX_RETRIES=0 to have Ray not run it again. Ray said: {said}"
    )


def unserializable_reason(error: BaseException) -> str:
    """Why Ray could not serialize a value: ``"TypeError: cannot pickle '_thread.lock' object"``.

    Ray wraps its pickler's ``TypeError`` in its own, "Could not serialize the
    argument <...> for a task or actor ...", whose first line (all a message
    quoted before) said nothing of why; the pickler's error is its
    ``__cause__``, also in its text (``!!! FAIL serialization: ...``), which
    names the variable that holds it (``FailTuple(lock [path=lock, ...])``)
    where Ray found one. Any other error (a ``__reduce__`` that raised
    ``ValueError``) Ray raises as it is: its type and message.

    Examples:
        >>> unserializable_reason(ValueError("not this one"))
        'ValueError: not this one'
    """
    text = plain_text(str(error))
    if not text.startswith("Could not serialize"):
        return _summary(error)
    cause = error.__cause__
    if isinstance(cause, Exception):
        reason = _summary(cause)
    else:
        failed = _FAILED.search(text)
        reason = failed.group(1).strip() if failed else first_line(error).rstrip(":")
    variable = _FAIL_TUPLE.search(text)
    if variable is not None and variable.group(1) != "unknown":
        reason += f" (Ray found it in the variable {variable.group(1)!r})"
    return reason


def _system_error(cause: BaseException) -> tuple[str, str]:
    """A ``RaySystemError``'s exception (``"ValueError: no"``) and the worker's traceback.

    Ray keeps the worker's exception as ``client_exc`` and its traceback as
    ``traceback_str``, whose last line names the exception's class.
    """
    remote_traceback = getattr(cause, "traceback_str", None)
    if isinstance(remote_traceback, str) and remote_traceback.strip():
        return remote_traceback.strip().splitlines()[-1], remote_traceback
    client = getattr(cause, "client_exc", None)
    summary = f"{type(client).__name__}: {client}" if isinstance(client, BaseException) else None
    return summary or plain_text(str(cause)), "(Ray sent none)\n"


def _unsendable_result(ray: Any, error: BaseException) -> BaseException | None:
    """Why Ray could not serialize the task's result, after ``_run`` returned; else None.

    ``_run`` answers for everything raised in it, fn's and its own, and Ray
    wraps an argument it cannot rebuild in ``RaySystemError``: a
    ``RayTaskError`` whose cause is not a Ray error comes from Ray's code
    after the return. Its traceback must also pass through Ray's serializer
    (``ray/cloudpickle``'s ``dumps``, in Ray 2.60's "cannot pickle
    '_thread.lock' object" and in a result whose ``__reduce__`` raised), in
    devicekit's task: the last task Ray names before that frame
    (``ray::devicekit.gpu_map()``, ``TASK_NAME``) must be ours. An item that
    is an ``ObjectRef`` whose own task's result could not be pickled reads
    ``ray::devicekit.gpu_map()``, "At least one of the input arguments for
    this task could not be computed", then ``ray::upstream()`` and the same
    frame: that is quoted as Ray words it, not blamed on the result (fn never
    ran). Ray's ``function_name`` cannot tell: ``ray.get`` raises an instance
    of the cause's class, where it reads the cause's attribute (Ray 2.60).
    Before the task had its name, Ray named it after its function, ``_run``,
    and an upstream task of that name was taken for ours.
    """
    cause = getattr(error, "cause", None)
    if (
        not isinstance(error, ray.exceptions.RayTaskError)
        or not isinstance(cause, BaseException)
        or isinstance(cause, ray.exceptions.RayError)
    ):
        return None
    text = _ESCAPE.sub("", str(error))
    frame = _SERIALIZER.search(text)
    tasks = _TASK.findall(text, 0, frame.start()) if frame is not None else []
    return cause if tasks and tasks[-1] == TASK_NAME else None


_SERIALIZER = re.compile(r'cloudpickle\.py", line \d+, in dumps?$', re.MULTILINE)
_TASK = re.compile(r"\bray::([\w.]+)\(\)")  # "ray::upstream() (pid=1234, ip=10.0.0.3)"
_NODE = re.compile(r"\bip=([^\s,)]+)")  # in Ray's "(pid=1234, ip=10.0.0.3)"
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # a terminal's colour or cursor code
_FAILED = re.compile(r"!!! FAIL serialization: (.+)")  # Ray's "cannot pickle '_thread.lock' ..."
_FAIL_TUPLE = re.compile(r"FailTuple\((\S+) \[")  # Ray's "FailTuple(lock [path=lock, obj=...])"


def plain_text(text: str) -> str:
    r"""Ray's error text without terminal colour codes, nor caret lines with nothing to mark.

    Ray colours the task's name (``\x1b[36mray::_run()\x1b[39m``), and after
    dropping its own frames keeps the ``^^^^`` lines that marked them.

    Examples:
        >>> plain_text("\x1b[36mray::_run()\x1b[39m (pid=7)\n    ^^^^^\nTypeError: no")
        'ray::_run() (pid=7)\nTypeError: no'
    """
    lines = _ESCAPE.sub("", text).splitlines()
    return "\n".join(line for line in lines if line.strip(" ^~") or not line.strip())
