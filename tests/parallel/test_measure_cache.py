"""RealMeasure keeps one train model at a time: a cached mesh's float32 masters are memory no cell accounts for."""

from __future__ import annotations

from earl_jax.models.model_config import get_config
from earl_jax.parallel.plan import StageLayout
from earl_jax.rl.job.measure import RealMeasure
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


def test_train_measure_holds_one_copy_of_the_weights():
    """The train cell donates the cached weights and caches the updated ones: no second float32 copy lives beside
    them while the step runs (the old copy, 12 GiB a GPU at 3B, is what ran Fig. 3's 3B train cells out of memory)."""
    import jax

    measure = RealMeasure(get_config("tiny", vocab_size=128), decode_steps=2, repeats=1)
    mesh = MeshShape.parse("d8f1t1")
    measure._run("train", StageLayout(mesh))
    before = measure._models[("train", mesh)][2]
    leaves = jax.tree.leaves(before)
    assert measure("train", mesh, 32, 8) > 0
    assert all(x.is_deleted() for x in leaves)  # donated to the step, not copied
    after = jax.tree.leaves(measure._models[("train", mesh)][2])
    assert len(after) == len(leaves) and not any(x.is_deleted() for x in after)
    assert measure("train", mesh, 32, 8) > 0  # the cached (updated) weights serve the next cell
