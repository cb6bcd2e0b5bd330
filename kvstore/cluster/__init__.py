"""Many nodes: the member list in etcd (``membership``, over etcd's JSON gateway in
``etcd``) and the client that places a prompt on one of them (``client``:
``ClusterClient``). The server uses membership and etcd only, never the client."""
