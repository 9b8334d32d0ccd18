"""benchmarks/kernel_census.py's reading of the CUDA graphs MLX writes (cudaGraphDebugDotPrint's
dot files, an excerpt of one written on an H100): every node by what it launches, kernels by their
short names, a child graph's node once and its own nodes apart, the clusters' labels not at all."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_census  # noqa: E402

DOT = '''digraph dot {
subgraph cluster_18893 {
label="graph_18893" graph[style="dashed"];
"graph_18893_node_0"[style="bold" shape="octagon" label="0
_ZN3mlx4core2cu4ropeI13__nv_bfloat16Lb0ELb1EEEvPKT_PS4_PKiffN4cuda3std3__45arrayIlLm4EEESE_li5uint3
"];

"graph_18893_node_1"[style="bold" shape="octagon" label="1
_ZN3mlx4core2cu22compute_dynamic_offsetIiLi1EEEvPKT_PxN4cuda3std3__45arrayIxLm10EEENSA_IiXT0_EEE
"];

"graph_18893_node_5"[style="solid" shape="rectangle" label="5
graph_18894
"];

"graph_18893_node_6"[style="bold" shape="octagon" label="6
_ZN3mlx4core2cu52custom_kernel_dspark_quantized_rows_mma_16_16_4_64_7EPK13__nv_bfloat16N4cuda3std3__45arrayIiLm10EEEPKjS9_S4_S4_PS2_
"];

"graph_18893_node_10"[style="bold" shape="octagon" label="10
_ZN3mlx4core2cu76CV2ISigmoidADV2IMultiplyACEV2OMultiplyDB_VV_V2V2_6142509188972423790_stridedILi2EjLi8EEEvPK13__nv_bfloat16N4cuda3std3__45arrayIxXT_EEES5_SA_PS3_NS9_IiXT_EEET0_
"];
"graph_18893_node_0" -> "graph_18893_node_1";
}
subgraph cluster_18895 {
label="graph_18895" graph[style="dashed"];
"graph_18895_node_0"[style="solid" shape="invtrapezium"label="0
MEMSET
(0,4)
"];

"graph_18895_node_1"[style="bold" shape="octagon" label="1
cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0
"];
}
}
'''


def test_the_census_names_each_kernel_of_a_dot_file(tmp_path):
    f = tmp_path / "g_1.dot"
    f.write_text(DOT)
    got = kernel_census.census([f])
    assert got == {"rope": 1, "compute_dynamic_offset": 1, "child graph": 1, "memset": 1,
                   "custom_kernel_dspark_quantized_rows_mma_16_16_4_64_7": 1,
                   "CV2ISigmoidADV2IMultiplyACEV2OMultiplyDB_VV_V2V2_strided": 1,
                   "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_": 1}
