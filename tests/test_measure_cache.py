"""RealMeasure keeps one train model at a time: a cached mesh's float32 masters are memory no cell accounts for."""

from __future__ import annotations

from earl_jax.models.config import get_config
from earl_jax.parallel.plan import StageLayout
from earl_jax.rl.measure import RealMeasure
from earl_jax.sharding.mesh import MeshShape


def test_train_keeps_one_model_and_rollout_keeps_one_per_mesh():
    measure = RealMeasure(get_config("tiny", vocab_size=128), decode_steps=2, repeats=1)
    meshes = [MeshShape.parse(m) for m in ("d8f1t1", "d4f1t2")]
    for mesh in meshes:
        measure._run("rollout", StageLayout(mesh))
    assert sorted(k[1] for k in measure._models) == sorted(meshes)  # rollout: bf16 copies stay cached per mesh
    for mesh in meshes:
        assert measure("train", mesh, 32, 8) > 0
        assert list(measure._models) == [("train", mesh)]  # the other stage's and the last train mesh's are gone
