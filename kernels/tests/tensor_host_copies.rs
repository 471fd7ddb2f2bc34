//! Host-to-device and device-to-host copies of `TensorKernels` (`upload`, `download`), the
//! transfers an offloaded optimizer makes, on the CPU device: bit for bit, windows only, and
//! refusals that write nothing.

use candle_core::{Device, Tensor};
use fsdp_kernels::tensor::TensorKernels;
use fsdp_kernels::{bf16, FlatBuffer, KernelError};
use fsdp_types::DType;

fn k() -> TensorKernels {
    TensorKernels::new(&Device::Cpu).unwrap()
}

#[test]
fn upload_writes_exactly_the_window() {
    let k = k();
    for via_tensor in [false, true] {
        let dst = k.zeros(DType::BF16, 8).unwrap();
        let src = FlatBuffer::BF16(
            [1.5f32, -2.25, 3.0, 99.0]
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect(),
        );
        if via_tensor {
            k.upload_via_tensor(&dst, 3, &src, 3).unwrap();
        } else {
            k.upload(&dst, 3, &src, 3).unwrap();
        }
        assert_eq!(
            k.to_f32(&dst).unwrap(),
            [0.0, 0.0, 0.0, 1.5, -2.25, 3.0, 0.0, 0.0],
            "via tensor: {via_tensor}"
        );
    }
}

#[test]
fn download_copies_bits_into_the_prefix() {
    let k = k();
    let bits = [f32::from_bits(0x7fc0_0001), -0.0, 1e-40, 3.5];
    let src = Tensor::from_slice(&bits, 4, &Device::Cpu).unwrap();
    let mut dst = FlatBuffer::F32(vec![7.0; 6]);
    k.download(&src, &mut dst).unwrap();
    let d = dst.as_f32().unwrap();
    for (a, b) in d[..4].iter().zip(bits) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
    assert_eq!(&d[4..], [7.0, 7.0]);
}

#[test]
fn mismatches_are_refused_and_write_nothing() {
    let k = k();
    let dst = k.zeros(DType::F32, 4).unwrap();
    let e = k
        .upload(&dst, 0, &FlatBuffer::BF16(vec![bf16::ONE; 4]), 4)
        .unwrap_err();
    assert!(matches!(e, KernelError::DTypeMismatch { .. }), "{e}");
    let e = k
        .upload(&dst, 2, &FlatBuffer::F32(vec![1.0; 4]), 3)
        .unwrap_err();
    assert!(matches!(e, KernelError::OffsetOutOfRange { .. }), "{e}");
    let e = k
        .upload(&dst, 0, &FlatBuffer::F32(vec![1.0; 2]), 3)
        .unwrap_err();
    assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    assert_eq!(k.to_f32(&dst).unwrap(), [0.0; 4]);
    let mut short = FlatBuffer::F32(vec![0.0; 3]);
    let e = k.download(&dst, &mut short).unwrap_err();
    assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    let mut wrong = FlatBuffer::BF16(vec![bf16::ZERO; 4]);
    assert!(k.download(&dst, &mut wrong).is_err());
}

#[test]
fn staging_prefixes_cast_and_accumulate_only_the_shard() {
    let mut b = FlatBuffer::BF16(vec![bf16::from_f32(9.0); 4]);
    b.copy_from_f32_prefix(&[1.0, 2.5]).unwrap();
    assert_eq!(
        b.as_bf16()
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect::<Vec<_>>(),
        [1.0, 2.5, 9.0, 9.0]
    );
    let mut dst = [0.5f32, 0.5];
    b.accumulate_prefix_into_f32(&mut dst).unwrap();
    assert_eq!(dst, [1.5, 3.0]);
    let e = b.copy_from_f32_prefix(&[0.0; 5]).unwrap_err();
    assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    let mut long = [0f32; 5];
    assert!(b.accumulate_prefix_into_f32(&mut long).is_err());
    assert_eq!(long, [0.0; 5], "nothing written");
}
