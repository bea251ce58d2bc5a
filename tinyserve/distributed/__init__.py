"""Ray as the distributed backend, beside the engine's own processes (vLLM's `ray` backends).

    --distributed-executor-backend ray   tensor-parallel ranks 1..N-1 as Ray actors
                                         (ray_ranks.py), in the engine process's placement group
    --data-parallel-backend ray          each data-parallel engine as a Ray actor (ray_engines.py),
                                         started by the API process's client (frontend/ray_client.py)

Code here runs in the API process (the client, the engines' actors' handles) and in the
engine processes (the ranks' handles); the actors themselves are Ray worker processes on
any node of the cluster. ray_cluster.py joins or starts the cluster and places actors;
actor_process.py makes an actor look like the child process it stands in for.

kv_transfer/ is what crosses between engines of a disaggregated deployment: a prompt's KV cache,
moved from the engine that computed it to the one that decodes it (vLLM's KV connectors).
"""
