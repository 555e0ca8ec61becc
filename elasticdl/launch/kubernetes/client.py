"""The project's own small API over the official ``kubernetes`` client.

Everything else in ElasticDL talks to Kubernetes through ``K8sClient``: objects are plain
dicts (the wire JSON), and every failure becomes a ``K8sError`` whose message says what
was refused and what to do (RBAC: which verb on which resource; a missing namespace; no
kubeconfig). Tests drive it against a local fake API server, never by patching HTTP.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

from elasticdl.errors import ElasticDLError, JobFailure, UserError

logger = logging.getLogger(__name__)

DEPLOY_MANIFEST = "dockerfiles/deploy.yaml"


class K8sError(ElasticDLError, RuntimeError):
    """A Kubernetes call failed; ``status`` is the HTTP status (0: no answer).

    The family of the Kubernetes errors: catch it to catch them all. It is on neither
    branch of the error tree; each subclass is: what the user can fix (kubeconfig,
    credentials, RBAC, namespace, a name in use, an invalid manifest, an image) is a
    UserError, what the cluster did (no answer, HTTP 5xx) a JobFailure. Raise a subclass."""

    def __init__(self, message: str, status: int = 0, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.reason = reason


class K8sClusterError(K8sError, JobFailure):
    """The cluster did not answer, or failed a request for a reason the user cannot fix
    (no connection, HTTP 5xx, 429): the job could not go on; running again may work."""


class K8sConfigError(K8sError, UserError):
    """No way to reach a cluster: neither in a pod nor a kubeconfig. Point $KUBECONFIG at one."""


class K8sUnauthorized(K8sError, UserError):
    """The API server did not accept our credentials (HTTP 401): fix the kubeconfig's user or token."""


class K8sForbidden(K8sError, UserError):
    """RBAC forbids the request (HTTP 403): the submitter or the master's service account
    needs the Role in dockerfiles/deploy.yaml."""


class K8sNotFound(K8sError, UserError):
    """The namespace or object does not exist (HTTP 404): check --namespace."""


class K8sConflict(K8sError, UserError):
    """The object exists already (HTTP 409): another job has this --job_name; pick another
    or delete that job's master pod."""


class K8sInvalid(K8sError, UserError):
    """Kubernetes refused a manifest as invalid (HTTP 422): a flag that shapes the pods
    (resources, volumes, --cluster_spec) is wrong."""


class K8sContainerError(K8sError, UserError):
    """A pod's container can never start: its image cannot be pulled (check --image_name,
    --image_pull_policy and that the cluster reaches the registry) or its configuration is
    invalid."""


class K8sGone(K8sError, JobFailure):
    """A watch's resourceVersion is too old (HTTP 410): list again. The watch loop handles
    it; escaping, it means the cluster's watch could not be resumed."""


def _require_client() -> None:
    """The kubernetes package is an extra: `make demo` and a local-only install leave it out."""
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        raise K8sConfigError(
            "--backend kubernetes needs the Kubernetes client: pip install 'elasticdl[kubernetes]' "
            "(or use --backend local)"
        ) from None


def load_api_client(kubeconfig: str = ""):
    """An ApiClient: in a pod, its service account; elsewhere $KUBECONFIG or ~/.kube/config."""
    _require_client()
    from kubernetes import client, config

    token_file = config.incluster_config.SERVICE_TOKEN_FILENAME
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(token_file):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    path = kubeconfig or os.environ.get("KUBECONFIG", "") or os.path.expanduser("~/.kube/config")
    paths = [p for p in path.split(os.pathsep) if p]
    if not any(os.path.exists(p) for p in paths):
        raise K8sConfigError(
            "cannot reach a Kubernetes cluster: not running in a pod (no service account token at "
            f"{token_file}) and no kubeconfig ({'KUBECONFIG=' + path if os.environ.get('KUBECONFIG') else path} "
            "does not exist). Point KUBECONFIG at your cluster's config (e.g. `kubectl config view` "
            "works), or use --backend local."
        )
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=paths[0], client_configuration=configuration)
    except Exception as err:  # ConfigException and YAML errors: say which file
        raise K8sConfigError(f"cannot load the kubeconfig {paths[0]}: {err}") from None
    return client.ApiClient(configuration)


class K8sClient:
    """Pods, services and secrets in one namespace, as dicts."""

    def __init__(self, namespace: str, api_client=None):
        _require_client()
        from kubernetes import client

        self.namespace = namespace
        self.api_client = api_client or load_api_client()
        self.core = client.CoreV1Api(self.api_client)

    @property
    def host(self) -> str:
        return self.api_client.configuration.host

    # ------------------------------------------------------------ calls

    def _call(self, verb: str, resource: str, fn, *args, name: str = "", **kwargs):
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        kwargs.setdefault("_preload_content", False)
        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            raise self._translate(err, verb, resource, name) from None
        except HTTPError as err:  # connection refused, DNS, TLS ...
            raise K8sClusterError(
                f"cannot reach the Kubernetes API at {self.host} ({verb} {resource}): {err}") from None
        except ValueError as err:  # the client's own schema check (pydantic), before any request
            if type(err).__name__ != "ValidationError":
                raise
            raise K8sInvalid(f"the {resource[:-1]} {name!r} does not match the Kubernetes schema: {err}",
                             422, "Invalid") from None

    def _translate(self, err, verb: str, resource: str, name: str) -> K8sError:
        status, message, reason, details = err.status or 0, str(err.reason or ""), "", {}
        try:
            body = json.loads(err.body or "{}")
            message, reason, details = body.get("message", message), body.get("reason", ""), body.get("details") or {}
        except (TypeError, ValueError):
            pass
        where = f"in namespace {self.namespace!r}"
        what = f"{resource}/{name}" if name else resource
        if status == 401:
            return K8sUnauthorized(
                f"the Kubernetes API at {self.host} did not accept our credentials ({verb} {what}): {message}. "
                "Check your kubeconfig's user or token.", status, reason)
        if status == 403:
            return K8sForbidden(
                f"Kubernetes RBAC forbids `{verb}` on `{resource}` {where}: {message}. The master's "
                f"service account needs the Role in {DEPLOY_MANIFEST}; the submitting user needs "
                "create on pods, services and secrets.", status, reason)
        if status == 404 and details.get("kind") == "namespaces":
            return K8sNotFound(
                f"namespace {self.namespace!r} does not exist: create it (kubectl create namespace "
                f"{self.namespace}) or pass --namespace with an existing one.", status, "NamespaceNotFound")
        if status == 404:
            return K8sNotFound(f"{what} not found {where}: {message}", status, reason)
        if status == 409:
            return K8sConflict(f"{what} already exists {where}: {message}", status, reason)
        if status == 410:
            return K8sGone(f"{verb} {resource}: {message}", status, reason)
        if status == 422:
            return K8sInvalid(f"Kubernetes refused the {resource[:-1]} {name!r} as invalid: {message}", status, reason)
        return K8sClusterError(f"{verb} {what} {where} failed (HTTP {status} {reason}): {message}", status, reason)

    @staticmethod
    def _json(resp) -> dict:
        """The body as JSON; reads it all before the connection goes back to the pool."""
        try:
            return json.loads(resp.data or b"{}")
        finally:
            resp.release_conn()

    # ------------------------------------------------------------ pods

    def create_pod(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        return self._json(self._call("create", "pods", self.core.create_namespaced_pod, self.namespace, body, name=name))

    def get_pod(self, name: str) -> dict | None:
        try:
            return self._json(self._call("get", "pods", self.core.read_namespaced_pod, name, self.namespace, name=name))
        except K8sNotFound:
            return None

    def delete_pod(self, name: str, grace_seconds: int | None = None) -> bool:
        """False when it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = int(grace_seconds)
        try:
            self._json(self._call("delete", "pods", self.core.delete_namespaced_pod, name, self.namespace,
                                  body=body, name=name))
            return True
        except K8sNotFound:
            return False

    def list_pods(self, selector: str) -> tuple[list[dict], str]:
        """(pods, resourceVersion of the list)."""
        data = self._json(self._call("list", "pods", self.core.list_namespaced_pod, self.namespace,
                                     label_selector=selector))
        return data.get("items") or [], data["metadata"].get("resourceVersion", "")

    def watch_pods(self, selector: str, resource_version: str, timeout_seconds: int = 30,
                   on_response=None) -> Iterator[tuple[str, dict]]:
        """(type, pod) events after ``resource_version`` until the server ends the watch.

        BOOKMARK events carry only a resourceVersion. Raises K8sGone (HTTP 410) when the
        version is too old: list again. ``on_response`` gets the open response (to close it).
        """
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._call(
            "watch", "pods", self.core.list_namespaced_pod, self.namespace, label_selector=selector,
            watch=True, resource_version=resource_version, timeout_seconds=timeout_seconds,
            allow_watch_bookmarks=True, _request_timeout=(10, timeout_seconds + 15),
        )
        if on_response is not None:
            on_response(resp)
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise self._translate(_StatusError(obj), "watch", "pods", "")
                yield event["type"], obj
        finally:
            resp.close()
            resp.release_conn()

    def pod_log(self, name: str, tail_lines: int | None = None) -> str:
        kwargs = {"tail_lines": tail_lines} if tail_lines else {}
        resp = self._call("get", "pods/log", self.core.read_namespaced_pod_log, name, self.namespace,
                          name=name, **kwargs)
        try:
            return resp.data.decode("utf-8", errors="replace")
        finally:
            resp.release_conn()

    def follow_log(self, name: str) -> Iterator[str]:
        """The pod's log lines as they come, until its container ends."""
        resp = self._call("get", "pods/log", self.core.read_namespaced_pod_log, name, self.namespace,
                          name=name, follow=True)
        try:
            buffer = b""
            for chunk in resp.stream(4096, decode_content=False):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
            if buffer:
                yield buffer.decode("utf-8", errors="replace")
        finally:
            resp.close()
            resp.release_conn()

    # ------------------------------------------------------------ services and secrets

    def create_service(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        return self._json(self._call("create", "services", self.core.create_namespaced_service, self.namespace,
                                     body, name=name))

    def get_service(self, name: str) -> dict | None:
        try:
            return self._json(self._call("get", "services", self.core.read_namespaced_service, name,
                                         self.namespace, name=name))
        except K8sNotFound:
            return None

    def delete_service(self, name: str) -> bool:
        try:
            self._json(self._call("delete", "services", self.core.delete_namespaced_service, name,
                                  self.namespace, name=name))
            return True
        except K8sNotFound:
            return False

    def create_secret(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        return self._json(self._call("create", "secrets", self.core.create_namespaced_secret, self.namespace,
                                     body, name=name))

    def delete_secret(self, name: str) -> bool:
        try:
            self._json(self._call("delete", "secrets", self.core.delete_namespaced_secret, name,
                                  self.namespace, name=name))
            return True
        except K8sNotFound:
            return False


class _StatusError:
    """A watch ERROR event's Status, shaped like an ApiException for ``_translate``."""

    def __init__(self, status: dict):
        self.status = status.get("code", 0)
        self.reason = status.get("reason", "")
        self.body = json.dumps(status)
