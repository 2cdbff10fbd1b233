// Hand-written LLVM-dialect functions covering the interpreter's op set
// (differential test against the MLIR ExecutionEngine in test_launch_abi.py).
module {
  llvm.func @cuda_load_to_device(%arg0: !llvm.ptr, %arg1: i32) -> i32 {
    %0 = llvm.mlir.constant(0 : i32) : i32
    llvm.return %0 : i32
  }
  llvm.func @arith32(%a: i32, %b: i32) -> i64 {
    %c0 = llvm.mlir.constant(31 : i32) : i32
    %b1 = llvm.and %b, %c0 : i32
    %1 = llvm.add %a, %b : i32
    %2 = llvm.mul %1, %a : i32
    %3 = llvm.sub %2, %b : i32
    %4 = llvm.shl %3, %b1 : i32
    %5 = llvm.ashr %a, %b1 : i32
    %6 = llvm.lshr %a, %b1 : i32
    %7 = llvm.xor %4, %5 : i32
    %8 = llvm.or %7, %6 : i32
    %9 = llvm.intr.smax(%a, %b) : (i32, i32) -> i32
    %10 = llvm.intr.umin(%a, %b) : (i32, i32) -> i32
    %11 = llvm.intr.smin(%9, %8) : (i32, i32) -> i32
    %12 = llvm.intr.umax(%10, %11) : (i32, i32) -> i32
    %13 = "llvm.intr.ctlz"(%12) <{is_zero_poison = false}> : (i32) -> i32
    %14 = "llvm.intr.cttz"(%8) <{is_zero_poison = false}> : (i32) -> i32
    %15 = "llvm.intr.ctpop"(%7) : (i32) -> i32
    %16 = "llvm.intr.abs"(%3) <{is_int_min_poison = false}> : (i32) -> i32
    %17 = llvm.add %13, %14 : i32
    %18 = llvm.add %17, %15 : i32
    %19 = llvm.xor %18, %16 : i32
    %20 = llvm.zext %19 : i32 to i64
    %21 = llvm.sext %12 : i32 to i64
    %c32 = llvm.mlir.constant(32 : i64) : i64
    %22 = llvm.shl %21, %c32 : i64
    %23 = llvm.xor %22, %20 : i64
    llvm.return %23 : i64
  }
  llvm.func @div(%a: i64, %b: i32) -> i64 {
    %t = llvm.trunc %a : i64 to i32
    %1 = llvm.sdiv %t, %b : i32
    %2 = llvm.srem %t, %b : i32
    %3 = llvm.udiv %a, %a : i64
    %bz = llvm.zext %b : i32 to i64
    %4 = llvm.udiv %a, %bz : i64
    %5 = llvm.urem %a, %bz : i64
    %s1 = llvm.sext %1 : i32 to i64
    %s2 = llvm.sext %2 : i32 to i64
    %x = llvm.xor %s1, %4 : i64
    %y = llvm.add %x, %5 : i64
    %z = llvm.mul %y, %s2 : i64
    %w = llvm.add %z, %3 : i64
    llvm.return %w : i64
  }
  llvm.func @cmp(%a: i16, %b: i16) -> i32 {
    %c1 = llvm.icmp "eq" %a, %b : i16
    %c2 = llvm.icmp "ne" %a, %b : i16
    %c3 = llvm.icmp "slt" %a, %b : i16
    %c4 = llvm.icmp "sle" %a, %b : i16
    %c5 = llvm.icmp "sgt" %a, %b : i16
    %c6 = llvm.icmp "sge" %a, %b : i16
    %c7 = llvm.icmp "ult" %a, %b : i16
    %c8 = llvm.icmp "ule" %a, %b : i16
    %c9 = llvm.icmp "ugt" %a, %b : i16
    %c10 = llvm.icmp "uge" %a, %b : i16
    %z1 = llvm.zext %c1 : i1 to i32
    %z2 = llvm.zext %c2 : i1 to i32
    %z3 = llvm.zext %c3 : i1 to i32
    %z4 = llvm.zext %c4 : i1 to i32
    %z5 = llvm.zext %c5 : i1 to i32
    %z6 = llvm.zext %c6 : i1 to i32
    %z7 = llvm.zext %c7 : i1 to i32
    %z8 = llvm.zext %c8 : i1 to i32
    %z9 = llvm.zext %c9 : i1 to i32
    %z10 = llvm.zext %c10 : i1 to i32
    %k1 = llvm.mlir.constant(1 : i32) : i32
    %s = llvm.shl %z2, %k1 : i32
    %r2 = llvm.or %z1, %s : i32
    %k2 = llvm.mlir.constant(2 : i32) : i32
    %s3 = llvm.shl %z3, %k2 : i32
    %r3 = llvm.or %r2, %s3 : i32
    %k3 = llvm.mlir.constant(3 : i32) : i32
    %s4 = llvm.shl %z4, %k3 : i32
    %r4 = llvm.or %r3, %s4 : i32
    %k4 = llvm.mlir.constant(4 : i32) : i32
    %s5 = llvm.shl %z5, %k4 : i32
    %r5 = llvm.or %r4, %s5 : i32
    %k5 = llvm.mlir.constant(5 : i32) : i32
    %s6 = llvm.shl %z6, %k5 : i32
    %r6 = llvm.or %r5, %s6 : i32
    %k6 = llvm.mlir.constant(6 : i32) : i32
    %s7 = llvm.shl %z7, %k6 : i32
    %r7 = llvm.or %r6, %s7 : i32
    %k7 = llvm.mlir.constant(7 : i32) : i32
    %s8 = llvm.shl %z8, %k7 : i32
    %r8 = llvm.or %r7, %s8 : i32
    %k8 = llvm.mlir.constant(8 : i32) : i32
    %s9 = llvm.shl %z9, %k8 : i32
    %r9 = llvm.or %r8, %s9 : i32
    %k9 = llvm.mlir.constant(9 : i32) : i32
    %s10 = llvm.shl %z10, %k9 : i32
    %r10 = llvm.or %r9, %s10 : i32
    %sel = llvm.select %c3, %a, %b : i1, i16
    %se = llvm.sext %sel : i16 to i32
    %k16 = llvm.mlir.constant(16 : i32) : i32
    %hi = llvm.shl %se, %k16 : i32
    %out = llvm.xor %r10, %hi : i32
    llvm.return %out : i32
  }
  llvm.func @mem(%a: i64, %i: i32, %v: i8) -> i64 {
    %one = llvm.mlir.constant(1 : i32) : i32
    %p = llvm.alloca %one x !llvm.struct<(i8, i32, i64, array<4 x i16>)> : (i32) -> !llvm.ptr
    %c24 = llvm.mlir.constant(24 : i64) : i64
    "llvm.intr.memset"(%p, %v, %c24) <{isVolatile = false}> : (!llvm.ptr, i8, i64) -> ()
    %f2 = llvm.getelementptr %p[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    llvm.store %a, %f2 : i64, !llvm.ptr
    %c3 = llvm.mlir.constant(3 : i32) : i32
    %im = llvm.and %i, %c3 : i32
    %e = llvm.getelementptr %p[0, 3, %im] : (!llvm.ptr, i32) -> !llvm.ptr, !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %t16 = llvm.trunc %a : i64 to i16
    llvm.store %t16, %e : i16, !llvm.ptr
    %q = llvm.alloca %one x !llvm.struct<(i8, i32, i64, array<4 x i16>)> : (i32) -> !llvm.ptr
    %c32 = llvm.mlir.constant(24 : i64) : i64
    "llvm.intr.memcpy"(%q, %p, %c32) <{isVolatile = false}> : (!llvm.ptr, !llvm.ptr, i64) -> ()
    %s = llvm.load %q : !llvm.ptr -> !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %x0 = llvm.extractvalue %s[0] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %x1 = llvm.extractvalue %s[1] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %x2 = llvm.extractvalue %s[2] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %x3 = llvm.extractvalue %s[3, 1] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %x4 = llvm.extractvalue %s[3, 2] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %s2 = llvm.insertvalue %x4, %s[3, 0] : !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    llvm.store %s2, %p : !llvm.struct<(i8, i32, i64, array<4 x i16>)>, !llvm.ptr
    %neg = llvm.mlir.constant(-1 : i32) : i32
    %f3 = llvm.getelementptr %p[0, 3, 1] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i8, i32, i64, array<4 x i16>)>
    %back = llvm.getelementptr %f3[%neg] : (!llvm.ptr, i32) -> !llvm.ptr, i16
    %y = llvm.load %back : !llvm.ptr -> i16
    %z0 = llvm.zext %x0 : i8 to i64
    %z1 = llvm.zext %x1 : i32 to i64
    %z3 = llvm.zext %x3 : i16 to i64
    %zy = llvm.zext %y : i16 to i64
    %pi = llvm.ptrtoint %p : !llvm.ptr to i64
    %qi = llvm.ptrtoint %q : !llvm.ptr to i64
    %c63 = llvm.mlir.constant(7 : i64) : i64
    %al = llvm.and %pi, %c63 : i64
    %r1 = llvm.add %z0, %z1 : i64
    %r2 = llvm.xor %r1, %x2 : i64
    %r3 = llvm.add %r2, %z3 : i64
    %k = llvm.mlir.constant(40 : i64) : i64
    %r4s = llvm.shl %zy, %k : i64
    %r4 = llvm.xor %r3, %r4s : i64
    %r5 = llvm.add %r4, %al : i64
    llvm.return %r5 : i64
  }
  llvm.func @fbits(%x: i32, %y: i32) -> i64 {
    %one = llvm.mlir.constant(1 : i32) : i32
    %f = llvm.mlir.constant(1.5 : f32) : f32
    %h = llvm.mlir.constant(-0.375 : f16) : f16
    %b = llvm.mlir.constant(3.0 : bf16) : bf16
    %d = llvm.mlir.constant(0.1 : f64) : f64
    %p = llvm.alloca %one x !llvm.struct<(f32, f16, bf16, f64)> : (i32) -> !llvm.ptr
    %u = llvm.mlir.undef : !llvm.struct<(f32, f16, bf16, f64)>
    %s1 = llvm.insertvalue %f, %u[0] : !llvm.struct<(f32, f16, bf16, f64)>
    %s2 = llvm.insertvalue %h, %s1[1] : !llvm.struct<(f32, f16, bf16, f64)>
    %s3 = llvm.insertvalue %b, %s2[2] : !llvm.struct<(f32, f16, bf16, f64)>
    %s4 = llvm.insertvalue %d, %s3[3] : !llvm.struct<(f32, f16, bf16, f64)>
    llvm.store %s4, %p : !llvm.struct<(f32, f16, bf16, f64)>, !llvm.ptr
    %q = llvm.getelementptr %p[0, 1] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(f32, f16, bf16, f64)>
    %w = llvm.load %q : !llvm.ptr -> i32
    %fi = llvm.bitcast %f : f32 to i32
    %r = llvm.xor %w, %fi : i32
    %q3 = llvm.getelementptr %p[0, 3] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(f32, f16, bf16, f64)>
    %dd = llvm.load %q3 : !llvm.ptr -> i64
    %rz = llvm.zext %r : i32 to i64
    %o = llvm.xor %dd, %rz : i64
    %xs = llvm.sext %x : i32 to i64
    %o2 = llvm.add %o, %xs : i64
    llvm.return %o2 : i64
  }
  llvm.func @helper(%x: i32, %y: i32) -> i32 {
    %r = llvm.mul %x, %y : i32
    llvm.return %r : i32
  }
  llvm.func @flow(%n: i32, %sel: i32) -> i32 {
    %zero = llvm.mlir.constant(0 : i32) : i32
    %one = llvm.mlir.constant(1 : i32) : i32
    llvm.br ^head(%zero, %one : i32, i32)
  ^head(%i: i32, %acc: i32):
    %c = llvm.icmp "slt" %i, %n : i32
    llvm.cond_br %c, ^body, ^exit(%acc : i32)
  ^body:
    %t = llvm.call @helper(%acc, %i) : (i32, i32) -> i32
    %u = llvm.add %t, %i : i32
    %i2 = llvm.add %i, %one : i32
    llvm.br ^head(%i2, %u : i32, i32)
  ^exit(%r: i32):
    llvm.switch %sel : i32, ^d(%r : i32) [
      1: ^c1,
      7: ^c7(%n : i32)
    ]
  ^c1:
    %k = llvm.mlir.constant(1000 : i32) : i32
    %x = llvm.add %r, %k : i32
    llvm.return %x : i32
  ^c7(%m: i32):
    %y = llvm.sub %r, %m : i32
    llvm.return %y : i32
  ^d(%v: i32):
    llvm.return %v : i32
  }
}
