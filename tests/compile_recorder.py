"""A torch.compile backend that records which operators reach the compiled graphs."""

from __future__ import annotations


def recording_backend():
    """``(backend, seen)``: a torch.compile backend that records the operators of the AOT
    forward and backward graphs into the list ``seen`` and runs the graphs unchanged
    (no Inductor code generation)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen: list[str] = []

    def compiler(graph, _inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes
                    if node.op == "call_function")
        return make_boxed_func(graph.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler,
                                     bw_compiler=compiler)

    return backend, seen
