"""Which launcher's coordinator decides, and the record a successor starts from.

Every node's launcher can run a coordinator; one leads. Leading is holding the key
`/recover/<job>/leader`, created only if absent (a transaction on its create revision) and tied
to an etcd lease of `ttl` seconds that the leader keeps alive. A leader that dies, or whose node
is cut off, stops keeping the lease; etcd deletes the key when the lease lapses, and another
campaigner creates it.

Two coordinators never decide at once: the leader key's create revision is the leadership's
fencing token (a new leadership always has a higher one), and every durable write is a
transaction that succeeds only while the leader key still has the writer's revision. A deposed
leader that has not noticed yet (a paused process, a partition) has its writes refused; it learns
it lost from that refusal or from a failed keep-alive, whichever comes first.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from recover_patches.collectives.etcd_cluster import EtcdCluster


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text(encoded: str) -> str:
    return base64.b64decode(encoded).decode()


@dataclass(frozen=True)
class Leadership:
    node: str  # the leading launcher's node
    address: str  # host:port of its coordinator's store: where ranks and launchers connect
    revision: int  # the leader key's create revision: the fencing token
    lease: int  # the etcd lease the key lives by (its id, as the key records it)


class Election:
    def __init__(self, cluster: EtcdCluster, job: str, ttl: int):
        if ttl < 1:
            raise ValueError(f"the leader's lease needs a TTL of at least 1 s, not {ttl}")
        self.cluster, self.ttl = cluster, ttl
        self.prefix = f"/recover/{job}/"
        self.leader_key = self.prefix + "leader"

    def _post(self, path: str, body: dict) -> dict:
        return self.cluster.call(lambda c: c.post(c.get_url(path), json=body))

    # --- leading -------------------------------------------------------------------------------
    def campaign(self, node: str, address: str) -> Leadership | None:
        """Lead if nobody does: the new Leadership, else None (read `leader()` for who does)."""
        lease = int(self._post("/lease/grant", {"TTL": self.ttl})["ID"])
        value = _b64(json.dumps({"node": node, "address": address}))
        key = _b64(self.leader_key)
        answer = self._post("/kv/txn", {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": value, "lease": lease}}],
            "failure": []})
        if not answer.get("succeeded"):
            self._revoke(lease)
            return None
        revision = int(answer["header"]["revision"])  # the put's revision: the key's creation
        return Leadership(node, address, revision, lease)

    def keep(self, leadership: Leadership) -> bool:
        """Renew the lease: False once it lapsed (the leadership is over; stop deciding)."""
        answer = self._post("/lease/keepalive", {"ID": leadership.lease})
        return int(answer.get("result", {}).get("TTL", -1)) > 0

    def resign(self, leadership: Leadership) -> None:
        """Give the leadership up now (a clean exit): the next campaigner needn't wait a TTL."""
        self._revoke(leadership.lease)

    def _revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    # --- following -----------------------------------------------------------------------------
    def leader(self) -> Leadership | None:
        """Who leads now (a linearizable read: never an old leader a member still remembers)."""
        answer = self._post("/kv/range", {"key": _b64(self.leader_key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        body = json.loads(_text(kvs[0]["value"]))
        return Leadership(body["node"], body["address"], int(kvs[0]["create_revision"]),
                          int(kvs[0].get("lease", 0)))

    # --- the durable record ---------------------------------------------------------------------
    def write(self, leadership: Leadership, name: str, record: dict) -> bool:
        """Store `record` under `name` if `leadership` still leads; False: fenced out."""
        answer = self._post("/kv/txn", {
            "compare": [{"key": _b64(self.leader_key), "result": "EQUAL", "target": "CREATE",
                         "create_revision": leadership.revision}],
            "success": [{"request_put": {"key": _b64(self.prefix + "state/" + name),
                                         "value": _b64(json.dumps(record))}}],
            "failure": []})
        return bool(answer.get("succeeded"))

    def read(self, name: str) -> dict | None:
        answer = self._post("/kv/range", {"key": _b64(self.prefix + "state/" + name)})
        kvs = answer.get("kvs") or []
        return json.loads(_text(kvs[0]["value"])) if kvs else None
