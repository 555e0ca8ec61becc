"""A fake Kubernetes API server on 127.0.0.1: the subset ElasticDL uses, with the real wire format.

Pods, services and secrets in namespaces: create, get, list (label selectors), delete,
watch (resourceVersion, 410 Gone once compacted, bookmarks), pod status patches, the pod
binding and log subresources. It refuses what a real server refuses: a duplicate name
(409 AlreadyExists), a missing namespace or object (404 NotFound), an invalid object
(422 Invalid: the OpenAPI schema through kubernetes-validate, plus the semantic checks a
real server makes), a missing token (401) and, when a test says so, RBAC (403): a
(user, verb, resource) it forbids, or all a Role's rules do not grant (``grant_only``).
Deleting a pod bound to a node is graceful (deletionTimestamp; the kubelet finishes it);
deleting an owner deletes its dependents (ownerReferences), as the garbage collector does.

Driven through the official ``kubernetes`` client by ElasticDL and by the tests.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

RESOURCES = {"pods": "Pod", "services": "Service", "secrets": "Secret"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[munkKMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {"": 1, "m": 1e-3, "u": 1e-6, "n": 1e-9, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "P": 1e15, "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_value(text: str) -> float:
    match = re.match(r"^([+-]?[0-9.]+)(.*)$", str(text))
    number, suffix = float(match.group(1)), match.group(2)
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * 10 ** int(suffix[1:])
    return number * _SUFFIX[suffix]


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


# ------------------------------------------------------------------ label selectors

def parse_selector(text: str):
    """Equality (a=b, a==b), inequality (a!=b), existence (a, !a) and sets (a in (x,y), a notin (x))."""
    terms = []
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", text or ""):
        part = part.strip()
        if not part:
            continue
        if m := re.match(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$", part):
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            terms.append((m.group(1), m.group(2), values))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in part:
            key, value = re.split(r"==?", part, maxsplit=1)
            terms.append((key.strip(), "=", value.strip()))
        elif part.startswith("!"):
            terms.append((part[1:].strip(), "!exists", None))
        else:
            terms.append((part, "exists", None))
    return terms


def selector_matches(terms, labels: dict) -> bool:
    for key, op, value in terms:
        have = labels.get(key)
        if op == "=" and have != value:
            return False
        if op == "!=" and have == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
        if op == "in" and have not in value:
            return False
        if op == "notin" and have in value:
            return False
    return True


# ------------------------------------------------------------------ validation (422)

def _invalid(kind: str, name: str, causes: list[tuple[str, str]]) -> ApiError:
    text = "; ".join(f"{field}: {msg}" for field, msg in causes)
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {text}', {
        "name": name, "kind": kind.lower() + "s",
        "causes": [{"reason": "FieldValueInvalid", "message": msg, "field": field} for field, msg in causes],
    })


def _schema_errors(obj: dict) -> list[tuple[str, str]]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=False)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path) or "<root>"
        return [(path, err.message)]
    return []


def validate_object(resource: str, obj: dict) -> None:
    kind = RESOURCES[resource]
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    causes: list[tuple[str, str]] = []
    name_re = _DNS_1035 if resource == "services" else _DNS_SUBDOMAIN
    if not name:
        causes.append(("metadata.name", "Required value: name or generateName is required"))
    elif not name_re.match(name) or len(name) > (63 if resource == "services" else 253):
        causes.append(("metadata.name", f'Invalid value: "{name}": must be a lowercase RFC 1123 name'))
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append((f"metadata.labels.{key}", f'Invalid value: "{value}": a valid label must be 63 '
                           "characters or less, alphanumeric, '-', '_' or '.'"))
    causes += _schema_errors(obj)
    if resource == "pods":
        causes += _pod_causes(obj.get("spec") or {})
    elif resource == "services":
        spec = obj.get("spec") or {}
        if not spec.get("ports"):
            causes.append(("spec.ports", "Required value"))
        for i, port in enumerate(spec.get("ports") or []):
            if not 1 <= int(port.get("port", 0)) <= 65535:
                causes.append((f"spec.ports[{i}].port", "Invalid value: must be between 1 and 65535"))
    elif resource == "secrets":
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(value, validate=True)
            except Exception:
                causes.append((f"data[{key}]", "Invalid value: not base64"))
    if causes:
        raise _invalid(kind, name, causes)


def _pod_causes(spec: dict) -> list[tuple[str, str]]:
    causes = []
    containers = spec.get("containers") or []
    if not containers:
        causes.append(("spec.containers", "Required value"))
    if spec.get("restartPolicy", "Always") not in ("Always", "OnFailure", "Never"):
        causes.append(("spec.restartPolicy", f'Unsupported value: "{spec.get("restartPolicy")}"'))
    volumes = [v.get("name") for v in spec.get("volumes") or []]
    if len(set(volumes)) != len(volumes):
        causes.append(("spec.volumes", "Duplicate value: volume names must be unique"))
    for i, c in enumerate(containers):
        where = f"spec.containers[{i}]"
        if not _DNS_LABEL.match(c.get("name", "")):
            causes.append((f"{where}.name", f'Invalid value: "{c.get("name")}"'))
        if not c.get("image"):
            causes.append((f"{where}.image", "Required value"))
        if c.get("imagePullPolicy", "Always") not in ("Always", "IfNotPresent", "Never"):
            causes.append((f"{where}.imagePullPolicy", f'Unsupported value: "{c.get("imagePullPolicy")}"'))
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in volumes:
                causes.append((f"{where}.volumeMounts.name", f'Not found: "{m.get("name")}"'))
        resources = c.get("resources") or {}
        for section in ("requests", "limits"):
            for key, value in (resources.get(section) or {}).items():
                if not _QUANTITY.match(str(value)):
                    causes.append((f"{where}.resources.{section}[{key}]",
                                   f'Invalid value: "{value}": must match the regular expression '
                                   "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"))
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for key, value in requests.items():
            if key in limits and _QUANTITY.match(str(value)) and _QUANTITY.match(str(limits[key])):
                if quantity_value(value) > quantity_value(limits[key]):
                    causes.append((f"{where}.resources.requests[{key}]",
                                   f'Invalid value: "{value}": must be less than or equal to {key} limit'))
        for key in requests:
            if "/" in key and not key.startswith("kubernetes.io/") and requests[key] != limits.get(key, requests[key]):
                causes.append((f"{where}.resources.requests[{key}]",
                               "Invalid value: must be equal to the limit (extended resource)"))
    return causes


# ------------------------------------------------------------------ the store

class Store:
    def __init__(self, service_subnet: str):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.rv = 100
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.events: list[tuple[int, str, str, str, dict]] = []  # (rv, resource, ns, type, obj)
        self.floor = 100  # watches from a resourceVersion below this get 410 Gone
        self.expired = 0  # bumped to end the open watches with 410
        self.namespaces: set[str] = set()
        self._service_subnet = service_subnet
        self._next_ip = 1

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _record(self, resource: str, ns: str, kind: str, obj: dict) -> None:
        self.events.append((self.rv, resource, ns, kind, copy.deepcopy(obj)))
        if len(self.events) > 20000:
            self.floor = self.events[5000][0]
            del self.events[:5000]
        self.changed.notify_all()

    def compact(self) -> None:
        """Forget the event history: every watch from an older resourceVersion gets 410 Gone."""
        with self.lock:
            self.floor = self.rv
            self.events.clear()

    def create(self, resource: str, ns: str, obj: dict) -> dict:
        with self.lock:
            if ns not in self.namespaces:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"})
            if obj.get("kind") != RESOURCES[resource]:
                raise ApiError(400, "BadRequest", f"the object's kind {obj.get('kind')!r} is not {RESOURCES[resource]}")
            meta = obj.setdefault("metadata", {})
            if meta.get("namespace", ns) != ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match "
                                                  "the namespace sent on the request")
            validate_object(resource, obj)
            name = meta["name"]
            if (resource, ns, name) in self.objects:
                raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists',
                               {"name": name, "kind": resource})
            obj = copy.deepcopy(obj)
            meta = obj["metadata"]
            meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now_iso(), resourceVersion=self._bump())
            if resource == "pods":
                spec = obj["spec"]
                spec.setdefault("restartPolicy", "Always")
                spec.setdefault("terminationGracePeriodSeconds", 30)
                spec.setdefault("schedulerName", "default-scheduler")
                spec.setdefault("serviceAccountName", "default")
                obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
            elif resource == "services":
                spec = obj["spec"]
                spec.setdefault("type", "ClusterIP")
                if spec.get("clusterIP") != "None":
                    spec["clusterIP"] = f"{self._service_subnet}.{self._next_ip // 250}.{self._next_ip % 250 + 2}"
                    spec["clusterIPs"] = [spec["clusterIP"]]
                    self._next_ip += 1
                obj["status"] = {"loadBalancer": {}}
            elif resource == "secrets":
                data = obj.setdefault("data", {})
                for key, value in (obj.pop("stringData", None) or {}).items():
                    data[key] = base64.b64encode(value.encode()).decode()
                obj.setdefault("type", "Opaque")
            self.objects[(resource, ns, name)] = obj
            self._record(resource, ns, "ADDED", obj)
            return copy.deepcopy(obj)

    def get(self, resource: str, ns: str, name: str) -> dict:
        with self.lock:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})
            return copy.deepcopy(obj)

    def list(self, resource: str, ns: str | None, selector: str = "") -> tuple[list[dict], str]:
        terms = parse_selector(selector)
        with self.lock:
            items = [copy.deepcopy(o) for (r, n, _), o in sorted(self.objects.items())
                     if r == resource and (ns is None or n == ns)
                     and selector_matches(terms, (o.get("metadata") or {}).get("labels") or {})]
            return items, str(self.rv)

    def update_status(self, ns: str, name: str, patch: dict) -> dict:
        with self.lock:
            obj = self.objects.get(("pods", ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            _merge(obj.setdefault("status", {}), patch.get("status") or {})
            obj["metadata"]["resourceVersion"] = self._bump()
            self._record("pods", ns, "MODIFIED", obj)
            return copy.deepcopy(obj)

    def bind(self, ns: str, name: str, node: str) -> None:
        with self.lock:
            obj = self.objects.get(("pods", ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            if obj["spec"].get("nodeName"):
                raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{obj["spec"]["nodeName"]}"')
            obj["spec"]["nodeName"] = node
            conditions = [c for c in obj["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
            obj["status"]["conditions"] = [*conditions, {"type": "PodScheduled", "status": "True"}]
            obj["metadata"]["resourceVersion"] = self._bump()
            self._record("pods", ns, "MODIFIED", obj)

    def delete(self, resource: str, ns: str, name: str, grace: int | None = None) -> dict:
        with self.lock:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})
            if resource == "pods":
                spec, status = obj["spec"], obj.get("status") or {}
                if grace is None:
                    grace = int(spec.get("terminationGracePeriodSeconds", 30))
                bound = spec.get("nodeName") and status.get("phase") not in ("Succeeded", "Failed")
                if bound and grace > 0:
                    meta = obj["metadata"]
                    current = meta.get("deletionGracePeriodSeconds")
                    if current is None or grace < current:
                        meta.setdefault("deletionTimestamp", now_iso())
                        meta["deletionGracePeriodSeconds"] = grace
                        meta["resourceVersion"] = self._bump()
                        self._record(resource, ns, "MODIFIED", obj)
                    return copy.deepcopy(obj)
            del self.objects[(resource, ns, name)]
            obj["metadata"]["resourceVersion"] = self._bump()
            self._record(resource, ns, "DELETED", obj)
            uid = obj["metadata"]["uid"]
        threading.Thread(target=self._collect_dependents, args=(ns, uid), daemon=True).start()
        return copy.deepcopy(obj)

    def _collect_dependents(self, ns: str, uid: str) -> None:
        """The garbage collector: objects whose ownerReferences name a deleted uid go too."""
        time.sleep(0.05)
        with self.lock:
            doomed = [(r, name) for (r, n, name), o in self.objects.items() if n == ns
                      and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])]
        for resource, name in doomed:
            try:
                self.delete(resource, ns, name)
            except ApiError:
                pass

    def events_after(self, rv: int, resource: str, ns: str | None, terms) -> list[tuple[int, str, dict]]:
        return [(v, kind, obj) for v, r, n, kind, obj in self.events
                if v > rv and r == resource and (ns is None or n == ns)
                and selector_matches(terms, (obj.get("metadata") or {}).get("labels") or {})]


def _merge(target: dict, patch: dict) -> None:
    """JSON merge patch (RFC 7386): dicts merge, everything else (lists too) replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


# ------------------------------------------------------------------ HTTP

_PATH = re.compile(
    r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>pods|services|secrets|namespaces)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|log|binding))?/?$"
)


def rbac_grants(rules: list[dict], verb: str, resource: str) -> bool:
    """Whether RBAC ``rules`` (a Role's) let ``verb`` on ``resource`` (``pods/log``...) of the core group."""
    return any(
        "" in rule.get("apiGroups", ()) and {resource, "*"} & set(rule.get("resources", ()))
        and {verb, "*"} & set(rule.get("verbs", ()))
        for rule in rules
    )


class FakeApiServer:
    """``with FakeApiServer() as api:`` serves on ``api.url``; ``api.store`` holds the objects."""

    def __init__(self, tokens: dict[str, str] | None = None, service_subnet: str = "127.200"):
        self.store = Store(service_subnet)
        self.tokens = tokens or {"admin-token": "admin"}  # bearer token -> user name
        self.forbidden: set[tuple[str, str, str]] = set()  # (user, verb, resource) refused with 403
        self.roles: dict[str, list[dict]] = {}  # user -> RBAC rules: all that user may do (see grant_only)
        self.log_paths: dict[tuple[str, str], str] = {}  # (ns, pod) -> the kubelet's log file
        self.requests: list[tuple[str, str, str]] = []  # (user, verb, resource), for tests
        self._fail_next: list[int] = []  # HTTP codes to answer the next requests with
        self._fail_filter = ("GET", "admin")
        self._stopping = threading.Event()
        handler = type("Handler", (_Handler,), {"api": self})
        self.httpd = _QuietServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self.store.lock:
            self.store.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def create_namespace(self, name: str) -> None:
        with self.store.lock:
            self.store.namespaces.add(name)

    def forbid(self, user: str, verb: str, resource: str) -> None:
        self.forbidden.add((user, verb, resource))

    def grant_only(self, user: str, rules: list[dict]) -> None:
        """RBAC for ``user``: a request no rule grants (core API group) is refused with 403."""
        self.roles[user] = rules

    def fail_next(self, *codes: int, method: str = "GET", user: str = "admin") -> None:
        """Answer the next ``method`` requests of ``user`` with these HTTP error codes (e.g. 500, 503)."""
        self._fail_filter = (method, user)
        self._fail_next.extend(codes)

    def expire_watches(self) -> None:
        """End every open watch with 410 Gone (a real server does when its watch cache falls behind)."""
        with self.store.lock:
            self.store.compact()
            self.store.expired += 1
            self.store.changed.notify_all()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # clients drop kept-alive connections when they exit


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"  # keep-alive; watches and followed logs are chunked, as on a real server

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_PUT(self) -> None:
        self._serve("PUT")

    # -------------------------------------------------------------- plumbing

    def _send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        raw = self._raw
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"the body is not JSON: {err}") from None

    def _user(self) -> str:
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        user = self.api.tokens.get(token)
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def _authorize(self, user: str, verb: str, resource: str, ns: str | None) -> None:
        self.api.requests.append((user, verb, resource))
        rules = self.api.roles.get(user)
        refused = rules is not None and not rbac_grants(rules, verb, resource)
        if refused or (user, verb, resource) in self.api.forbidden or (user, "*", resource) in self.api.forbidden:
            group, _, sub = resource.partition("/")
            where = f' in the namespace "{ns}"' if ns else " at the cluster scope"
            raise ApiError(403, "Forbidden",
                           f'{resource} is forbidden: User "{user}" cannot {verb} resource "{group}"'
                           f'{" (subresource " + sub + ")" if sub else ""} in API group ""{where}',
                           {"kind": group})

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self._raw = self.rfile.read(length) if length else b""  # always: the connection is kept alive
        try:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            match = _PATH.match(url.path)
            if url.path in ("/version", "/version/"):
                return self._send_json(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake"})
            if not match:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
            user = self._user()
            if self.api._fail_next and (method, user) == self.api._fail_filter:
                code = self.api._fail_next.pop(0)
                raise ApiError(code, "InternalError" if code == 500 else "ServiceUnavailable", "injected failure")
            ns, resource, name, sub = match.group("ns"), match.group("resource"), match.group("name"), match.group("sub")
            if resource == "namespaces":
                return self._namespace(user, method, name)
            self._dispatch(user, method, ns, resource, name, sub, query)
        except ApiError as err:
            self._send_json(err.code, err.status())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _namespace(self, user: str, method: str, name: str | None) -> None:
        self._authorize(user, "get" if name else "list", "namespaces", None)
        store = self.api.store
        if method != "GET":
            raise ApiError(405, "MethodNotAllowed", "only GET on namespaces here")
        if name is None:
            items = [{"metadata": {"name": n}, "status": {"phase": "Active"}} for n in sorted(store.namespaces)]
            return self._send_json(200, {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {}, "items": items})
        if name not in store.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{name}" not found', {"name": name, "kind": "namespaces"})
        self._send_json(200, {"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": name},
                              "status": {"phase": "Active"}})

    def _dispatch(self, user, method, ns, resource, name, sub, query) -> None:
        store = self.api.store
        if sub == "log":
            self._authorize(user, "get", "pods/log", ns)
            return self._log(ns, name, query)
        if sub == "binding":
            self._authorize(user, "create", "pods/binding", ns)
            body = self._body()
            store.bind(ns, name, (body.get("target") or {}).get("name", ""))
            return self._send_json(201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201})
        if sub == "status":
            self._authorize(user, "update" if method == "PUT" else "patch", "pods/status", ns)
            return self._send_json(200, store.update_status(ns, name, self._body()))
        if method == "GET" and name:
            self._authorize(user, "get", resource, ns)
            return self._send_json(200, store.get(resource, ns, name))
        if method == "GET" and query.get("watch") in ("true", "1"):
            self._authorize(user, "watch", resource, ns)
            return self._watch(resource, ns, query)
        if method == "GET":
            self._authorize(user, "list", resource, ns)
            items, rv = store.list(resource, ns, query.get("labelSelector", ""))
            return self._send_json(200, {"kind": RESOURCES[resource] + "List", "apiVersion": "v1",
                                         "metadata": {"resourceVersion": rv}, "items": items})
        if method == "POST" and not name:
            self._authorize(user, "create", resource, ns)
            return self._send_json(201, store.create(resource, ns, self._body()))
        if method == "DELETE" and name:
            self._authorize(user, "delete", resource, ns)
            body = self._body()
            grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            return self._send_json(200, store.delete(resource, ns, name, None if grace is None else int(grace)))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {self.path}")

    def _stream_start(self, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _stream_end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _event(self, kind: str, obj: dict) -> None:
        self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    def _watch(self, resource: str, ns: str | None, query: dict) -> None:
        store, terms = self.api.store, parse_selector(query.get("labelSelector", ""))
        timeout = min(float(query.get("timeoutSeconds") or 1800), 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        deadline = time.monotonic() + timeout
        since = query.get("resourceVersion", "")
        self._stream_start()
        with store.lock:
            generation = store.expired
            if since in ("", "0"):
                items, rv = store.list(resource, ns, query.get("labelSelector", ""))
                pending = [(int(rv), "ADDED", item) for item in items]
                cursor = int(rv)
            elif int(since) < store.floor:
                self._event("ERROR", ApiError(410, "Expired", f"too old resource version: {since} "
                                              f"({store.floor})").status())
                self._stream_end()
                return
            else:
                cursor = int(since)
                pending = []
        while not self.api._stopping.is_set():
            for _, kind, obj in pending:
                self._event(kind, obj)
            with store.lock:
                if store.expired != generation:
                    self._event("ERROR", ApiError(410, "Expired", f"too old resource version: {cursor} "
                                                  f"({store.floor})").status())
                    self._stream_end()
                    return
                pending = store.events_after(cursor, resource, ns, terms)
                if pending:
                    cursor = pending[-1][0]
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                store.changed.wait(min(left, 1.0))
        if bookmarks:
            self._event("BOOKMARK", {"kind": RESOURCES[resource], "apiVersion": "v1",
                                     "metadata": {"resourceVersion": str(cursor)}})
        self._stream_end()

    def _log(self, ns: str, name: str, query: dict) -> None:
        store = self.api.store
        store.get("pods", ns, name)  # 404 for a pod that does not exist
        path = self.api.log_paths.get((ns, name))
        if path is None:
            raise ApiError(400, "BadRequest", f'container "main" in pod "{name}" is waiting to start: ContainerCreating')
        follow = query.get("follow") in ("true", "1")
        tail = int(query["tailLines"]) if "tailLines" in query else None
        with open(path, "rb") as f:
            data = f.read()
        if tail is not None:
            data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail else b""
        if not follow:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._stream_start("text/plain")
        with open(path, "rb") as f:
            while not self.api._stopping.is_set():
                chunk = f.read(65536)
                if chunk:
                    self._chunk(chunk)
                    continue
                try:
                    pod = store.get("pods", ns, name)
                except ApiError:
                    pod = None
                statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
                ended = pod is None or any("terminated" in (s.get("state") or {}) for s in statuses)
                if ended:
                    self._chunk(f.read())
                    break
                time.sleep(0.1)
        self._stream_end()
