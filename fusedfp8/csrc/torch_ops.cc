// fusedfp8 host shim for torch: the CUDA implementation of the fusedfp8::* custom ops (defined in
// Python by fusedfp8/pytorch/custom_ops.py) in C++, so that eager calls, torch.compile graphs and
// CUDA graphs launch the kernels without running Python per call.
//
// - CUDA kernels (boxed) of quantize, quantize_t, gelu_quantize, gelu_quantize_t,
//   dgelu_quantize_t and dequantize: a call is looked up in a cache keyed by its signature
//   (op, dtypes, rows/cols, device, 16-byte alignment of the inputs, state shapes and dtypes,
//   index, format, flags); a new signature calls back into Python once, under the GIL
//   (op_plans._cpp_plan: the full argument check of fusedfp8.ops, then the launch plan of
//   fusedfp8.launch), and the plan is kept. A hot call checks devices and contiguity, allocates
//   its outputs with at::empty on the caller's device, and runs the plan (plan.h) on torch's
//   current stream.
// - AutogradCUDA kernels that stand in for the Python Autograd and ADInplaceOrView kernels that
//   torch.library.custom_op registers: with no gradient needed they bump the version of the
//   mutated state arguments and redispatch below ADInplaceOrView; when grad mode is on and an
//   argument requires grad they call back into Python (cpp_path._cpp_grad_path), which keeps
//   the custom op's behaviour (outputs whose backward raises).
// - `call(op_index, *args)`: the same implementation for the eager fast path (custom_ops.call),
//   without a dispatcher round trip; it bumps the versions of the state it writes, as the
//   dispatcher does.
//
// Compiles against the CPU-only torch wheel: the CUDA stream comes through c10's device guard
// interface, outputs through at::empty (the dispatcher), the driver through plan.h.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "plan.h"
#include "torch_gemm.h"

namespace {

enum Op : int64_t { kQuantize, kQuantizeT, kGelu, kGeluT, kDgeluT, kDequant, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"quantize",        "quantize_t",       "gelu_quantize",
                                           "gelu_quantize_t", "dgelu_quantize_t", "dequantize"};

// The buffer slots of the plans these ops run, by name, in the order of fusedfp8.launch.plans
// QUANTIZE_SLOTS / DEQUANTIZE_SLOTS (tests/kernels/test_launch_layout.py holds the two orders against
// each other); the ops fill each slot by its name.
namespace quantize_slot {
enum : size_t {
  kX, kB, kQ, kQT, kDbias, kPartial, kCounters, kScale, kAmax, kScaleOut, kScaleInvOut, kScaleInvUsed, kUpdates,
  kCount
};
}  // namespace quantize_slot
namespace dequantize_slot {
enum : size_t { kQ, kOut, kScaleInv, kCount };
}  // namespace dequantize_slot

bool has_transpose(Op op) { return op == kQuantizeT || op == kGeluT || op == kDgeluT; }
bool has_approximate(Op op) { return op == kGelu || op == kGeluT || op == kDgeluT; }

// ---- Python callbacks ------------------------------------------------------------------------
PyObject* g_plan_fn = nullptr;  // op_plans._cpp_plan(op_name, args) -> (plan, names, part_rows, n_counters, e5m2)
PyObject* g_grad_fn = nullptr;  // cpp_path._cpp_grad_path(op_name, args) -> outputs

struct Gil {
  PyGILState_STATE s = PyGILState_Ensure();
  ~Gil() { PyGILState_Release(s); }
};

[[noreturn]] void throw_python_error() {
  python_error e;
  e.persist();
  throw e;
}

PyObject* ivalue_to_py(const c10::IValue& v, const c10::Argument& arg) {
  if (v.isTensor()) return THPVariable_Wrap(v.toTensor());
  if (v.isNone()) Py_RETURN_NONE;
  if (v.isBool()) return PyBool_FromLong(v.toBool());
  if (v.isInt()) {
    if (arg.real_type()->kind() == c10::TypeKind::ScalarTypeType) {  // type() says int for a ScalarType
      PyObject* d = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt())));
      Py_INCREF(d);
      return d;
    }
    return PyLong_FromLongLong(v.toInt());
  }
  if (v.isSymInt()) return PyLong_FromLongLong(v.toSymInt().guard_int(__FILE__, __LINE__));
  if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
  if (v.isString()) {
    const std::string& s = v.toStringRef();
    return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  }
  TORCH_CHECK(false, "fusedfp8: unexpected argument type ", v.tagKind(), " for ", arg.name());
}

// The op's arguments (the top `n` of the stack) as a Python tuple (new reference).
PyObject* stack_to_py(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(args.size()));
  if (t == nullptr) throw_python_error();
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* o = ivalue_to_py(args[i], schema.arguments()[i]);
    if (o == nullptr) {
      Py_DECREF(t);
      throw_python_error();
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), o);
  }
  return t;
}

// ---- the plan cache ----------------------------------------------------------------------------
struct Key {
  std::array<int64_t, 24> v{};
  bool operator==(const Key& o) const { return v == o.v; }
};
struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t x : k.v) {
      h ^= static_cast<uint64_t>(x);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};
struct Entry {
  std::vector<int64_t> plan;
  std::string names;
  int64_t part_rows = 0;   // dbias workspace rows (row tiles)
  int64_t n_counters = 0;  // dbias strip counters
  bool e5m2 = false;       // the FP8 format of the outputs (else E4M3)
};

std::mutex g_mu;
std::unordered_map<Key, std::shared_ptr<const Entry>, KeyHash> g_cache;

std::shared_ptr<const Entry> find(const Key& k) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_cache.find(k);
  return it == g_cache.end() ? nullptr : it->second;
}

// Python's verdict on a new signature: raises (python_error) or returns the plan, kept when
// `keep` (a key that does not name the call exactly, such as a format alias, is not kept).
template <class MakeArgs>
std::shared_ptr<const Entry> plan_from_python(Op op, const Key& k, bool keep, MakeArgs make_args) {
  Gil gil;
  TORCH_CHECK(g_plan_fn != nullptr, "fusedfp8: the C++ ops are not registered (call register() first)");
  PyObject* args = make_args();  // new reference
  PyObject* r = PyObject_CallFunction(g_plan_fn, "sO", kOpNames[op], args);
  Py_DECREF(args);
  if (r == nullptr) throw_python_error();
  auto e = std::make_shared<Entry>();
  char* bytes = nullptr;
  Py_ssize_t nbytes = 0;
  const char* names = nullptr;
  Py_ssize_t nnames = 0;
  long long part_rows = 0, n_counters = 0;
  int e5m2 = 0;
  PyObject* plan_obj = nullptr;
  PyObject* names_obj = nullptr;
  bool ok = PyArg_ParseTuple(r, "SULLp", &plan_obj, &names_obj, &part_rows, &n_counters, &e5m2) &&
            PyBytes_AsStringAndSize(plan_obj, &bytes, &nbytes) == 0 &&
            (names = PyUnicode_AsUTF8AndSize(names_obj, &nnames)) != nullptr;
  if (!ok) {
    Py_DECREF(r);
    throw_python_error();
  }
  e->plan.resize(static_cast<size_t>(nbytes) / sizeof(int64_t));
  std::memcpy(e->plan.data(), bytes, e->plan.size() * sizeof(int64_t));
  e->names.assign(names, static_cast<size_t>(nnames));
  e->part_rows = part_rows;
  e->n_counters = n_counters;
  e->e5m2 = e5m2 != 0;
  Py_DECREF(r);
  if (!keep) return e;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_cache.emplace(k, std::move(e)).first->second;
}

void* current_stream(const c10::Device& device) {
  static const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(device).native_handle();
}

uint64_t addr(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// Runs the plan on torch's current stream of `device`, in that device's context (the caller's
// current device may be another GPU).
void run_plan(const Entry& e, const uint64_t* bufs, size_t nbuf, const c10::Device& device) {
  ff8::ContextGuard ctx(device.index());
  TORCH_CHECK(ctx.error().empty(), ctx.error());
  std::string err = ff8::run(e.plan.data(), e.plan.size(), bufs, nbuf, device.index(), current_stream(device), e.names);
  TORCH_CHECK(err.empty(), err);
}

int64_t code_of(std::string_view s, std::string_view a, std::string_view b) { return s == a ? 0 : s == b ? 1 : -1; }

int64_t float_bits(double v) {
  int64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  return bits;
}

// ---- quantize ----------------------------------------------------------------------------------
struct QArgs {
  at::Tensor x, b, hist, scale, scale_inv, updates;  // b: the forward input of dgelu, else undefined
  int64_t index = 0;
  std::string_view fmt, approximate = "tanh";
  double margin_factor = 1.0;
  bool current_first = false, dbias = false;
  int64_t pad_to = 1;  // q is (rows, cols) rounded up to multiples of it (and q_t its transpose)
};

bool same_place(const at::Tensor& t, const at::Tensor& x) {
  return t.defined() && t.device() == x.device() && t.is_contiguous();
}

template <class MakeArgs>
std::vector<at::Tensor> quantize(Op op, const QArgs& a, MakeArgs make_args) {
  const at::Tensor& x = a.x;
  TORCH_CHECK(x.defined() && x.is_cuda(), "fusedfp8: the C++ ops run CUDA tensors");
  const bool cheap_ok = x.is_contiguous() && same_place(a.hist, x) && same_place(a.scale, x) &&
                        same_place(a.scale_inv, x) && same_place(a.updates, x) &&
                        (!a.b.defined() || (same_place(a.b, x) && a.b.sizes() == x.sizes() &&
                                            a.b.scalar_type() == x.scalar_type()));
  const int64_t ndim = x.dim();
  const int64_t cols = ndim ? x.size(-1) : 1;
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < ndim; ++d) rows *= x.size(d);
  Key k;
  auto& v = k.v;
  v[0] = op;
  v[1] = static_cast<int64_t>(x.scalar_type());
  v[2] = x.device().index();
  v[3] = ndim == 0;
  v[4] = rows;
  v[5] = cols;
  v[6] = static_cast<int64_t>(addr(x) % 16);
  v[7] = a.b.defined() ? static_cast<int64_t>(addr(a.b) % 16) : -1;
  v[8] = a.hist.dim();
  v[9] = a.hist.dim() ? a.hist.size(-1) : -1;
  v[10] = a.hist.numel();
  v[11] = static_cast<int64_t>(addr(a.hist) % 4);
  v[12] = a.scale.dim() * 1000003 + a.scale.numel();
  v[13] = a.scale_inv.dim() * 1000003 + a.scale_inv.numel();
  v[14] = a.updates.dim() * 1000003 + a.updates.numel();
  v[15] = (static_cast<int64_t>(a.hist.scalar_type()) << 24) | (static_cast<int64_t>(a.scale.scalar_type()) << 16) |
          (static_cast<int64_t>(a.scale_inv.scalar_type()) << 8) | static_cast<int64_t>(a.updates.scalar_type());
  v[16] = a.index;
  v[17] = code_of(a.fmt, "e4m3", "e5m2");
  v[18] = has_approximate(op) ? code_of(a.approximate, "tanh", "none") : 0;
  v[19] = a.current_first;
  v[20] = a.dbias;
  v[21] = float_bits(a.margin_factor);
  v[22] = a.pad_to;
  const bool exact = v[17] >= 0 && v[18] >= 0;  // a format or approximation alias is checked at every call
  std::shared_ptr<const Entry> e = cheap_ok && exact ? find(k) : nullptr;
  if (e == nullptr) {
    e = plan_from_python(op, k, cheap_ok && exact, make_args);  // raises for a call that fails the check
    TORCH_CHECK(cheap_ok, "fusedfp8: the custom ops need contiguous inputs and state tensors on the input's device");
  }
  c10::DeviceGuard guard(x.device());
  const at::ScalarType fp8 = e->e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
  const auto f32 = x.options().dtype(at::kFloat);
  const int64_t p = a.pad_to > 1 ? a.pad_to : 1;  // checked > 0 by Python with the signature
  const int64_t prows = (rows + p - 1) / p * p, pcols = (cols + p - 1) / p * p;
  at::Tensor q = p > 1 ? at::empty({prows, pcols}, x.options().dtype(fp8)) : at::empty(x.sizes(), x.options().dtype(fp8));
  at::Tensor q_t = has_transpose(op) ? at::empty({pcols, prows}, x.options().dtype(fp8)) : at::Tensor();
  at::Tensor si = at::empty({1}, f32);
  at::Tensor db, partial, counters;
  if (a.dbias) {
    db = at::empty({cols}, f32);
    partial = at::empty({e->part_rows, cols}, f32);
    counters = at::empty({e->n_counters}, x.options().dtype(at::kInt));  // zeroed by the plan
  }
  uint64_t bufs[quantize_slot::kCount] = {};
  {
    using namespace quantize_slot;
    bufs[kX] = addr(x);
    bufs[kB] = addr(a.b);
    bufs[kQ] = addr(q);
    bufs[kQT] = addr(q_t);
    bufs[kDbias] = addr(db);
    bufs[kPartial] = addr(partial);
    bufs[kCounters] = addr(counters);
    bufs[kScale] = addr(a.scale);  // the state's, at the tensor's index (the plan's offset)
    bufs[kAmax] = addr(a.hist);    // row 0 of the history
    bufs[kScaleOut] = addr(a.scale);
    bufs[kScaleInvOut] = addr(a.scale_inv);
    bufs[kScaleInvUsed] = addr(si);
    bufs[kUpdates] = addr(a.updates);
  }
  run_plan(*e, bufs, quantize_slot::kCount, x.device());
  switch (op) {
    case kQuantize:
    case kGelu:
      return {q, si};
    case kQuantizeT:
    case kGeluT:
      return {q, q_t, si};
    default:
      return {q, q_t, a.dbias ? db : at::empty({0}, f32), si};
  }
}

QArgs qargs_from_stack(Op op, c10::ArrayRef<c10::IValue> s) {
  QArgs a;
  size_t i = 0;
  a.x = s[i++].toTensor();
  if (op == kDgeluT) a.b = s[i++].toTensor();
  a.hist = s[i++].toTensor();
  a.scale = s[i++].toTensor();
  a.scale_inv = s[i++].toTensor();
  a.updates = s[i++].toTensor();
  a.index = s[i].isInt() ? s[i].toInt() : s[i].toSymInt().guard_int(__FILE__, __LINE__);  // SymInt in the schema
  ++i;
  a.fmt = s[i++].toStringRef();
  a.margin_factor = s[i++].toDouble();
  a.current_first = s[i++].toBool();
  if (has_approximate(op)) a.approximate = s[i++].toStringRef();
  if (op == kDgeluT) a.dbias = s[i++].toBool();
  if (i < s.size()) a.pad_to = s[i].isInt() ? s[i].toInt() : s[i].toSymInt().guard_int(__FILE__, __LINE__);
  return a;
}

// ---- dequantize --------------------------------------------------------------------------------
template <class MakeArgs>
at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scale_inv, at::ScalarType dtype, MakeArgs make_args) {
  TORCH_CHECK(q.defined() && q.is_cuda(), "fusedfp8: the C++ ops run CUDA tensors");
  const bool cheap_ok = q.is_contiguous() && scale_inv.defined() && scale_inv.device() == q.device();
  Key k;
  auto& v = k.v;
  v[0] = kDequant;
  v[1] = static_cast<int64_t>(q.scalar_type());
  v[2] = q.device().index();
  v[3] = q.numel();
  v[4] = static_cast<int64_t>(addr(q) % 16);
  v[5] = static_cast<int64_t>(dtype);
  v[6] = scale_inv.numel();
  v[7] = static_cast<int64_t>(scale_inv.scalar_type());
  std::shared_ptr<const Entry> e = cheap_ok ? find(k) : nullptr;
  if (e == nullptr) {
    e = plan_from_python(kDequant, k, cheap_ok, make_args);
    TORCH_CHECK(cheap_ok, "fusedfp8: dequantize needs a contiguous q and scale_inv on q's device");
  }
  c10::DeviceGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  uint64_t bufs[dequantize_slot::kCount] = {};
  bufs[dequantize_slot::kQ] = addr(q);
  bufs[dequantize_slot::kOut] = addr(out);
  bufs[dequantize_slot::kScaleInv] = addr(scale_inv);
  run_plan(*e, bufs, dequantize_slot::kCount, q.device());
  return out;
}

// ---- dispatcher kernels ------------------------------------------------------------------------
template <Op op>
void cuda_kernel(const c10::OperatorHandle& handle, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = handle.schema();
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  auto make_args = [&] { return stack_to_py(schema, args); };
  std::vector<at::Tensor> outs;
  if constexpr (op == kDequant)
    outs.push_back(dequantize(args[0].toTensor(), args[1].toTensor(), args[2].toScalarType(), make_args));
  else
    outs = quantize(op, qargs_from_stack(op, args), make_args);
  torch::jit::drop(*stack, n);
  for (auto& t : outs) stack->emplace_back(std::move(t));
}

// What the ADInplaceOrView kernel does for a mutated argument: autograd's check of saved tensors
// then sees the write (an inference tensor has no version counter).
void bump_version(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void autograd_kernel(const c10::OperatorHandle& handle, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = handle.schema();
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  bool needs_grad = false;
  if (c10::GradMode::is_enabled())
    for (const auto& a : args)
      if (a.isTensor() && a.toTensor().requires_grad()) needs_grad = true;
  if (needs_grad) {  // the Python autograd kernel's behaviour (rare: the library calls these under no_grad)
    Gil gil;
    TORCH_CHECK(g_grad_fn != nullptr, "fusedfp8: the C++ ops are not registered");
    PyObject* py_args = stack_to_py(schema, args);
    const std::string& qualified = handle.operator_name().name;  // "fusedfp8::quantize"
    PyObject* r = PyObject_CallFunction(g_grad_fn, "sO", qualified.substr(qualified.rfind(':') + 1).c_str(), py_args);
    Py_DECREF(py_args);
    if (r == nullptr) throw_python_error();
    torch::jit::drop(*stack, n);
    if (THPVariable_Check(r)) {
      stack->emplace_back(THPVariable_Unpack(r));
    } else {
      const Py_ssize_t k = PyTuple_Check(r) ? PyTuple_GET_SIZE(r) : -1;
      for (Py_ssize_t i = 0; i < k; ++i) stack->emplace_back(THPVariable_Unpack(PyTuple_GET_ITEM(r, i)));
      if (k < 0) {
        Py_DECREF(r);
        TORCH_CHECK(false, "fusedfp8: the grad path returned neither a tensor nor a tuple");
      }
    }
    Py_DECREF(r);
    return;
  }
  for (size_t i = 0; i < n; ++i) {  // what the ADInplaceOrView kernel does for a mutated argument
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite() && args[i].isTensor()) bump_version(args[i].toTensor());
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  handle.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
}

std::unique_ptr<torch::Library> g_cuda_lib, g_autograd_lib;

template <size_t... I>
void register_cuda(torch::Library& lib, std::index_sequence<I...>) {
  (lib.impl(kOpNames[I], torch::CppFunction::makeFromBoxedFunction<&cuda_kernel<static_cast<Op>(I)>>()), ...);
}

// ---- the Python module -------------------------------------------------------------------------
#define FF8_CATCH                                                     \
  catch (python_error & e) {                                   \
    e.restore();                                                      \
    return nullptr;                                                   \
  }                                                                   \
  catch (const c10::Error& e) {                                       \
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());  \
    return nullptr;                                                   \
  }                                                                   \
  catch (const std::exception& e) {                                   \
    PyErr_SetString(PyExc_RuntimeError, e.what());                    \
    return nullptr;                                                   \
  }

PyObject* py_register(PyObject*, PyObject* args) {
  PyObject *plan_fn, *grad_fn;
  if (!PyArg_ParseTuple(args, "OO", &plan_fn, &grad_fn)) return nullptr;
  try {
    if (g_cuda_lib == nullptr) {
      Py_INCREF(plan_fn);
      Py_INCREF(grad_fn);
      Py_XDECREF(g_plan_fn);
      Py_XDECREF(g_grad_fn);
      g_plan_fn = plan_fn;
      g_grad_fn = grad_fn;
      auto cuda = std::make_unique<torch::Library>(torch::Library::IMPL, "fusedfp8", c10::DispatchKey::CUDA,
                                                   __FILE__, __LINE__);
      register_cuda(*cuda, std::make_index_sequence<kNumOps>{});
      auto ag = std::make_unique<torch::Library>(torch::Library::IMPL, "fusedfp8", c10::DispatchKey::AutogradCUDA,
                                                 __FILE__, __LINE__);
      for (const char* name : kOpNames) ag->impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
      g_cuda_lib = std::move(cuda);
      g_autograd_lib = std::move(ag);
    }
    Py_RETURN_NONE;
  }
  FF8_CATCH
}

PyObject* py_unregister(PyObject*, PyObject*) {
  try {
    g_autograd_lib.reset();  // the registrations go with their Library objects
    g_cuda_lib.reset();
    Py_RETURN_NONE;
  }
  FF8_CATCH
}

PyObject* py_registered(PyObject*, PyObject*) { return PyBool_FromLong(g_cuda_lib != nullptr); }

const at::Tensor& tensor_arg(PyObject* o, const char* name) {
  if (!THPVariable_Check(o)) {
    PyErr_Format(PyExc_TypeError, "fusedfp8: %s must be a tensor; got %s", name, Py_TYPE(o)->tp_name);
    throw_python_error();
  }
  return THPVariable_Unpack(o);
}

std::string_view str_arg(PyObject* o, const char* name) {
  Py_ssize_t k = 0;
  const char* s = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &k) : nullptr;
  if (s == nullptr) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "fusedfp8: %s must be a str", name);
    throw_python_error();
  }
  return {s, static_cast<size_t>(k)};
}

PyObject* wrap_all(const std::vector<at::Tensor>& outs) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(outs.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < outs.size(); ++i) PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), THPVariable_Wrap(outs[i]));
  return t;
}

// call(op_index, *args): the op on CUDA tensors, for the eager fast path (no dispatcher).
PyObject* py_call(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  try {
    if (argc < 1) {
      PyErr_SetString(PyExc_TypeError, "call(op_index, *args)");
      return nullptr;
    }
    const long long op_index = PyLong_AsLongLong(argv[0]);
    if (op_index < 0 || op_index >= kNumOps) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fusedfp8: unknown op index");
      return nullptr;
    }
    const Op op = static_cast<Op>(op_index);
    PyObject* const* a = argv + 1;
    const Py_ssize_t n = argc - 1;
    auto make_args = [&] {
      PyObject* t = PyTuple_New(n);
      if (t == nullptr) throw_python_error();
      for (Py_ssize_t i = 0; i < n; ++i) {
        Py_INCREF(a[i]);
        PyTuple_SET_ITEM(t, i, a[i]);
      }
      return t;
    };
    if (op == kDequant) {
      if (n != 3 || !THPDtype_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "fusedfp8: dequantize(q, scale_inv, dtype: torch.dtype)");
        return nullptr;
      }
      const at::Tensor& q = tensor_arg(a[0], "q");
      const at::Tensor& si = tensor_arg(a[1], "scale_inv");
      return THPVariable_Wrap(dequantize(q, si, reinterpret_cast<THPDtype*>(a[2])->scalar_type, make_args));
    }
    const Py_ssize_t want = 9 + (op == kDgeluT) + has_approximate(op) + (op == kDgeluT);
    if (n != want && n != want + 1) {  // + pad_to (default 1)
      PyErr_Format(PyExc_TypeError, "fusedfp8: %s takes %zd or %zd arguments; got %zd", kOpNames[op], want,
                   want + 1, n);
      return nullptr;
    }
    QArgs q;
    Py_ssize_t i = 0;
    q.x = tensor_arg(a[i++], op == kDgeluT ? "dy" : "x");
    if (op == kDgeluT) q.b = tensor_arg(a[i++], "x");
    q.hist = tensor_arg(a[i++], "amax_history");
    q.scale = tensor_arg(a[i++], "scale");
    q.scale_inv = tensor_arg(a[i++], "scale_inv");
    q.updates = tensor_arg(a[i++], "updates");
    q.index = PyLong_AsLongLong(a[i++]);
    if (q.index == -1 && PyErr_Occurred()) return nullptr;
    q.fmt = str_arg(a[i++], "fmt");
    q.margin_factor = PyFloat_AsDouble(a[i++]);
    if (q.margin_factor == -1.0 && PyErr_Occurred()) return nullptr;
    const int cf = PyObject_IsTrue(a[i++]);
    if (cf < 0) return nullptr;
    q.current_first = cf;
    if (has_approximate(op)) q.approximate = str_arg(a[i++], "approximate");
    if (op == kDgeluT) {
      const int db = PyObject_IsTrue(a[i++]);
      if (db < 0) return nullptr;
      q.dbias = db;
    }
    if (n == want + 1) {
      q.pad_to = PyLong_AsLongLong(a[i++]);
      if (q.pad_to == -1 && PyErr_Occurred()) return nullptr;
    }
    std::vector<at::Tensor> outs = quantize(op, q, make_args);
    for (const at::Tensor* t : {&q.hist, &q.scale, &q.scale_inv}) bump_version(*t);  // the schema's (a!) arguments
    return wrap_all(outs);
  }
  FF8_CATCH
}

// dry_run(plan: bytes, ptrs: tuple[int], device: int, names: str) -> bytes: what the plan would hand
// the driver, its kernels resolved in `device`'s registry (tests).
PyObject* py_dry_run(PyObject*, PyObject* args) {
  const char* plan = nullptr;
  Py_ssize_t nplan = 0;
  PyObject* ptrs = nullptr;
  long long device = 0;
  const char* names = nullptr;
  if (!PyArg_ParseTuple(args, "y#O!Ls", &plan, &nplan, &PyTuple_Type, &ptrs, &device, &names)) return nullptr;
  const Py_ssize_t nbuf = PyTuple_GET_SIZE(ptrs);
  std::vector<uint64_t> bufs(static_cast<size_t>(nbuf));
  for (Py_ssize_t i = 0; i < nbuf; ++i) {
    bufs[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ptrs, i));
    if (PyErr_Occurred()) return nullptr;
  }
  std::vector<int64_t> p(static_cast<size_t>(nplan) / sizeof(int64_t));
  std::memcpy(p.data(), plan, p.size() * sizeof(int64_t));
  std::vector<unsigned char> out(1 << 16);
  ff8::RecordSink sink{out.data(), out.size()};
  std::string err = ff8::walk(p.data(), p.size(), bufs.data(), bufs.size(), device, names, sink);
  if (!err.empty()) {
    PyErr_SetString(PyExc_ValueError, err.c_str());
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()), static_cast<Py_ssize_t>(sink.used));
}

// register_kernels(device: int, ids: bytes, funcs: bytes): the int64 ids[i] is the handle funcs[i]
// (uint64) on CUDA device `device` (fusedfp8.csrc.register_kernels, for every module loaded).
PyObject* py_register_kernels(PyObject*, PyObject* args) {
  long long device = 0;
  const char* ids = nullptr;
  const char* funcs = nullptr;
  Py_ssize_t nids = 0, nfuncs = 0;
  if (!PyArg_ParseTuple(args, "Ly#y#", &device, &ids, &nids, &funcs, &nfuncs)) return nullptr;
  if (nids != nfuncs || nids % 8) {
    PyErr_SetString(PyExc_ValueError, "register_kernels: ids and funcs must be 8 bytes each, as many of both");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nids / 8; ++i) {
    int64_t id = 0;
    uint64_t func = 0;
    std::memcpy(&id, ids + 8 * i, 8);
    std::memcpy(&func, funcs + 8 * i, 8);
    std::string err = ff8::kernels::add(device, id, func);
    if (!err.empty()) {
      PyErr_SetString(PyExc_ValueError, err.c_str());
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

PyObject* py_cache_size(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lock(g_mu);
  return PyLong_FromSize_t(g_cache.size());
}

PyObject* py_clear_cache(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_cache.clear();
  Py_RETURN_NONE;
}

PyObject* py_plan_version(PyObject*, PyObject*) { return PyLong_FromLongLong(ff8::kPlanVersion); }

PyObject* py_gemm_set_library(PyObject*, PyObject* args) {
  const char* path = nullptr;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  std::lock_guard<std::mutex> g(ff8::lt::lock());
  ff8::lt::library_path() = path;
  Py_RETURN_NONE;
}

PyObject* py_gemm_set_workspace(PyObject*, PyObject* args) {
  long long bytes = -1;
  if (!PyArg_ParseTuple(args, "L", &bytes)) return nullptr;
  if (bytes < 0 || bytes > (1LL << 32)) {
    PyErr_Format(PyExc_ValueError, "gemm_set_workspace: bytes must be in 0 .. 2**32; got %lld", bytes);
    return nullptr;
  }
  return PyLong_FromLongLong(ff8::torch_gemm::workspace_bytes().exchange(bytes));
}

PyObject* py_gemm_workspace(PyObject*, PyObject*) {
  return PyLong_FromLongLong(ff8::torch_gemm::workspace_bytes().load());
}

// The id of the stream capture in progress on `stream` (unique over the process's lifetime), 0 when the
// stream is not capturing; None where the driver cannot say.
PyObject* py_capture_id(PyObject*, PyObject* arg) {
  unsigned long long handle = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  const ff8::Driver& d = ff8::driver();
  if (d.capture_info == nullptr) Py_RETURN_NONE;
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE / _ACTIVE (1) / _INVALIDATED
  unsigned long long id = 0;
  if (d.capture_info(reinterpret_cast<ff8::CUstream>(handle), &status, &id, nullptr, nullptr, nullptr, nullptr) != 0)
    Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(status == 1 ? id : 0ULL);
}

PyMethodDef kMethods[] = {
    {"register", py_register, METH_VARARGS,
     "register(plan_fn, grad_fn): install the CUDA and AutogradCUDA kernels of the fusedfp8 ops"},
    {"unregister", py_unregister, METH_NOARGS, "remove them again (the Python implementations take over)"},
    {"registered", py_registered, METH_NOARGS, "whether they are installed"},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call)), METH_FASTCALL,
     "call(op_index, *args): run an op on CUDA tensors without the dispatcher"},
    {"dry_run", py_dry_run, METH_VARARGS,
     "dry_run(plan, ptrs, device, names) -> bytes: what the plan would hand the driver (tests)"},
    {"register_kernels", py_register_kernels, METH_VARARGS,
     "register_kernels(device, ids, funcs): the kernels (int64 ids, uint64 handles) of a module loaded on device"},
    {"cache_size", py_cache_size, METH_NOARGS, "signatures with a cached plan"},
    {"clear_cache", py_clear_cache, METH_NOARGS, "forget every cached plan"},
    {"plan_version", py_plan_version, METH_NOARGS, "the plan format this module reads"},
    {"capture_id", py_capture_id, METH_O,
     "capture_id(stream_handle) -> int | None: the stream capture in progress (unique per process), 0 if none"},
    {"gemm_set_library", py_gemm_set_library, METH_VARARGS,
     "gemm_set_library(path): where fusedfp8::fp8_gemm_lt loads cuBLASLt from when the process has none loaded"},
    {"gemm_set_workspace", py_gemm_set_workspace, METH_VARARGS,
     "gemm_set_workspace(bytes) -> previous: the cuBLASLt workspace of fusedfp8::fp8_gemm_lt's later calls"},
    {"gemm_workspace", py_gemm_workspace, METH_NOARGS, "the cuBLASLt workspace bytes of fusedfp8::fp8_gemm_lt"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_ff8_torch", "fusedfp8's torch launch shim (C++)", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

// the cuBLASLt FP8 GEMMs (torch_gemm.h): defined here, with their CUDA and Meta kernels
TORCH_LIBRARY_FRAGMENT(fusedfp8, m) {
  m.def("fp8_gemm_lt(Tensor a, Tensor b, Tensor scale_inv_a, Tensor scale_inv_b, ScalarType out_dtype, "
        "bool fast_accum=False, Tensor? bias=None) -> Tensor");
  m.def("fp8_gemm_lt_block(Tensor a, Tensor b, Tensor scale_inv_a, Tensor scale_inv_b, int a_block, int b_block, "
        "ScalarType out_dtype, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(fusedfp8, CUDA, m) {
  m.impl("fp8_gemm_lt", &ff8::torch_gemm::cuda<&current_stream>);
  m.impl("fp8_gemm_lt_block", &ff8::torch_gemm::cuda_block<&current_stream>);
}
TORCH_LIBRARY_IMPL(fusedfp8, Meta, m) {
  m.impl("fp8_gemm_lt", &ff8::torch_gemm::meta);
  m.impl("fp8_gemm_lt_block", &ff8::torch_gemm::meta_block);
}

PyMODINIT_FUNC PyInit__ff8_torch(void) { return PyModule_Create(&kModule); }
