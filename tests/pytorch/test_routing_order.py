"""Where horovod-topk routes Horovod: in a new process, ``hvd.DistributedOptimizer`` looked up before TopKEF is
(``hvd.DistributedOptimizer(..., compression=ht.TopKEF(...))``) must be the routed function once
``horovod_topk.torch`` is imported after ``horovod.torch``; without Horovod loaded, importing the package loads
none of it."""
from tests.new_process import run_code


def test_the_function_looked_up_before_topkef_is_the_routed_one():
    out = run_code("""
        import horovod.torch as hvd
        import horovod_topk.torch as ht
        import torch
        hvd.init()
        model = torch.nn.Linear(8, 8)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                       compression=ht.TopKEF(ratio=0.1, target="update"))
        print("update mode installed:", hasattr(opt, "topk_update_step"))
    """)
    assert "update mode installed: True" in out


def test_importing_the_package_without_horovod_loaded_loads_none_of_it():
    out = run_code("""
        import sys
        import horovod_topk.torch
        from horovod_topk.torch.ddp import TopKEFState
        print("horovod loaded:", any(name == "horovod" or name.startswith("horovod.") for name in sys.modules))
    """)
    assert "horovod loaded: False" in out
