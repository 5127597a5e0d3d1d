"""Expected results of the OpInfo sweep (tests/opinfo_sweep.py, tests/test_opinfo.py).

Regenerate from a full run: ``python tests/opinfo_sweep.py --all --write-expected tests/opinfo_expected.py``.
Coverage only goes up: tests fail when an op listed here becomes exact (remove it), and when an op
not listed becomes unsupported, refused, wrong or crashes.
Last full run: 540 ops: 480 exact, 7 unsupported, 17 refused, 3 wrong (known: torch inconsistent), 0 crash, 33 skipped.
"""

# op -> the ATen overload hoad has no rule for
UNSUPPORTED = {
    'fft.hfft': 'aten._to_copy.default (complex)',
    'fft.hfft2': 'aten._to_copy.default (complex)',
    'fft.hfftn': 'aten._to_copy.default (complex)',
    'fft.irfft': 'aten._to_copy.default (complex)',
    'fft.irfft2': 'aten._to_copy.default (complex)',
    'fft.irfftn': 'aten._to_copy.default (complex)',
    'linalg.eig': 'aten.linalg_eig.default (complex)',
}

# op -> the HoadError hoad raises (capture, control flow, output, ...)
REFUSED = {
    '_batch_norm_with_update': 'forward via op: CaptureError: the function updates in place a tensor it does not receive at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)) (a buffer of a module it reaches thr',
    '_native_batch_norm_legit': 'forward via op: CaptureError: the function updates in place a tensor it does not receive at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)) (a buffer of a module it reaches thr',
    'as_strided.partial_views': "forward via op: InvalidArgumentError: the function calls as_strided, which reads a tensor's storage, and input 'x' is a view into a larger storage (offset 5, strides (1,)); hoad's program reads its in",
    'bernoulli': 'forward via op: RandomnessError: the function draws random numbers (aten.rand.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determin',
    'combinations': 'forward via op: DataDependentControlFlowError: a shape depends on tensor values (aten.masked_select.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)), e.g. boolean-ma',
    'corrcoef': 'forward via op: DataDependentControlFlowError: Python control flow or a shape depends on tensor values at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)). One derivative progra',
    'cov': 'forward via op: DataDependentControlFlowError: Python control flow or a shape depends on tensor values at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)). One derivative progra',
    'linalg.lstsq': "forward via op: DataDependentControlFlowError: aten.linalg_lstsq returns tensors whose shapes depend on its input's values at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); o",
    'linalg.lstsq.grad_oriented': "forward via op: DataDependentControlFlowError: aten.linalg_lstsq returns tensors whose shapes depend on its input's values at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); o",
    'masked_select': 'forward via op: DataDependentControlFlowError: a shape depends on tensor values (aten.masked_select.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)), e.g. boolean-ma',
    'nn.functional.feature_alpha_dropout.with_train': 'forward via op: RandomnessError: the function draws random numbers (aten.bernoulli.p) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determini',
    'nn.functional.fractional_max_pool2d': 'forward via op: RandomnessError: the function draws random numbers (aten.rand.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determin',
    'nn.functional.multi_head_attention_forward': 'forward via op: RandomnessError: the function draws random numbers (aten.bernoulli.p) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determini',
    'nn.functional.rrelu': 'forward via op: RandomnessError: the function draws random numbers (aten.uniform.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be deter',
    'normal': 'forward via op: RandomnessError: the function draws random numbers (aten.normal.Tensor_Tensor) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be ',
    'pca_lowrank': 'forward via op: RandomnessError: the function draws random numbers (aten.randn.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determi',
    'svd_lowrank': 'forward via op: RandomnessError: the function draws random numbers (aten.randn.default) at tests/opinfo_sweep.py: return post(wrapper(fn, first, *args, **kwargs)); a derivative program must be determi',
}

# op -> why it is wrong or crashes today: reported, not failed; remove entries as they are fixed
KNOWN_BROKEN = {
    'nn.functional.max_unpool1d': 'forward via op: order 1: duplicate indices: only the surviving write carries a derivative in hoad (both directions); torch\'s backward credits every duplicate, its forward mode the survivor [OpInfo samples with repeated indices]',
    'nn.functional.max_unpool2d': 'forward via op: order 1: duplicate indices: only the surviving write carries a derivative in hoad (both directions); torch\'s backward credits every duplicate, its forward mode the survivor [OpInfo samples with repeated indices]',
    'nn.functional.max_unpool3d': 'forward via op: order 1: duplicate indices: only the surviving write carries a derivative in hoad (both directions); torch\'s backward credits every duplicate, its forward mode the survivor [OpInfo samples with repeated indices]',
}
