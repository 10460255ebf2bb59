// The per-call work of a served call, done in C++: the call key, the check of
// the tensors a program binds, the donated buffers' bookkeeping around a
// run, and the bridge's counters. Each function has a Python twin that the
// package uses where this module is not built (torch_xla_patches/native.py;
// the counters' is torch_xla's own binding); both give the same answers, and
// test_native.py holds them to it.
//
// [Note: The native fast path]
// A served decode step does about 60 Python-level calls into torch and
// torch_xla around one `_run_cached_graph`: per tensor leaf four attribute
// reads for the key, per donated cache two ids before the run and four calls
// after it. Each is cheap alone, but inside a serving loop, where the host
// runs other code between steps, the interpreter's footprint makes them
// several times dearer than in a micro-benchmark. Here each function is one
// call from Python, its loops in C++. Invariants:
//   * The GIL is held throughout: the functions only read tensor metadata,
//     edit functionalization's wrappers and call torch_xla's Python
//     bindings, none of which blocks.
//   * A key is a tuple (bytes, objects...): the bytes encode the structure
//     and each tensor's metadata, the objects are what must compare by
//     Python equality (constants, dict keys, keyword names, tensor
//     subclasses, shardings), in walk order. Two calls get equal keys exactly
//     where call_spec's Python key would be equal.
//   * The data ledger is the bridge's Python dict (tensor id -> (data id,
//     given)); these functions read and write it as the bridge's Python
//     code does, under the bridge's execution_lock held by the caller.
#include <Python.h>

#include <ATen/FunctionalTensorWrapper.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/lazy/core/metrics.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

// Tags of the key's bytes.
enum Tag : int64_t {
  kTensor = 1,
  kTensorSubclass = 2,
  kTuple = 3,
  kList = 4,
  kDict = 5,
  kConstant = 6,
  kKeywords = 7,
  kObject = 8,
};

// Deeper (or cyclic) structures are not keyed: call_spec._MAX_DEPTH.
constexpr int kMaxDepth = 64;

// bool, int, float, str, NoneType: call_spec._CONSTANT_TYPES, in order.
PyTypeObject* const kConstantTypes[] = {&PyBool_Type, &PyLong_Type,
                                        &PyFloat_Type, &PyUnicode_Type,
                                        Py_TYPE(Py_None)};

// torch_xla's bindings the ledger needs, set by init().
PyObject* data_id_fn = nullptr;
PyObject* tensor_id_fn = nullptr;
// call_spec's object keying, as call_key() was last given it: type ->
// whether it is keyed as an object (a dict), the function that decides it for
// a type not in the dict yet, and the constant types an object may hold
// (torch.device, torch.dtype). Borrowed: call_spec holds them for good.
PyObject* keyed_object_types = nullptr;
PyObject* is_keyed_object_fn = nullptr;
PyObject* object_constant_types = nullptr;

// 1: instances of `type` are keyed as objects; 0: not; -1: an error is set.
int is_keyed_object(PyTypeObject* type) {
  if (keyed_object_types == nullptr || is_keyed_object_fn == nullptr) {
    return 0;
  }
  PyObject* known =
      PyDict_GetItemWithError(keyed_object_types, (PyObject*)type);
  if (known == nullptr) {
    if (PyErr_Occurred()) {
      return -1;
    }
    known = PyObject_CallOneArg(is_keyed_object_fn, (PyObject*)type);
    if (known == nullptr) {
      return -1;
    }
    int answer = PyObject_IsTrue(known);
    Py_DECREF(known);
    return answer;
  }
  return PyObject_IsTrue(known);
}

struct KeyWalk {
  std::vector<int64_t> bytes;
  PyObject* objects;  // list
  PyObject* leaves;   // list
  PyObject* sharding_of;  // callable or None
  std::vector<PyObject*> tensors;
};

// 0: walked; 1: the value cannot be keyed; -1: a Python error is set.
int walk(KeyWalk& w, PyObject* value, int depth) {
  if (depth > kMaxDepth) {
    return 1;
  }
  PyTypeObject* type = Py_TYPE(value);
  if (THPVariable_Check(value)) {
    if (PyList_Append(w.leaves, value) < 0) {
      return -1;
    }
    w.tensors.push_back(value);
    if (type == (PyTypeObject*)THPVariableClass) {
      w.bytes.push_back(kTensor);
    } else {
      w.bytes.push_back(kTensorSubclass);
      if (PyList_Append(w.objects, (PyObject*)type) < 0) {
        return -1;
      }
    }
    const at::Tensor& tensor = THPVariable_Unpack(value);
    try {
      if (tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
        return 1;
      }
      at::IntArrayRef sizes = tensor.sizes();
      w.bytes.push_back(static_cast<int64_t>(sizes.size()));
      w.bytes.insert(w.bytes.end(), sizes.begin(), sizes.end());
      w.bytes.push_back(static_cast<int64_t>(tensor.scalar_type()));
      w.bytes.push_back(static_cast<int64_t>(tensor.device().type()));
      w.bytes.push_back(static_cast<int64_t>(tensor.device().index()));
      w.bytes.push_back(tensor.requires_grad() ? 1 : 0);
    } catch (const std::exception&) {
      // A tensor without sizes (a nested tensor): not keyed, as in Python.
      return 1;
    }
    if (w.sharding_of != Py_None) {
      PyObject* sharding = PyObject_CallOneArg(w.sharding_of, value);
      if (sharding == nullptr) {
        return -1;
      }
      int appended = PyList_Append(w.objects, sharding);
      Py_DECREF(sharding);
      if (appended < 0) {
        return -1;
      }
    }
    return 0;
  }
  if (type == &PyTuple_Type || type == &PyList_Type) {
    bool is_tuple = type == &PyTuple_Type;
    Py_ssize_t size = is_tuple ? PyTuple_GET_SIZE(value) : PyList_GET_SIZE(value);
    w.bytes.push_back(is_tuple ? kTuple : kList);
    w.bytes.push_back(size);
    for (Py_ssize_t i = 0; i < size; ++i) {
      // A list may shrink while a sharding function runs.
      if (!is_tuple && i >= PyList_GET_SIZE(value)) {
        return 1;
      }
      PyObject* item =
          is_tuple ? PyTuple_GET_ITEM(value, i) : PyList_GET_ITEM(value, i);
      Py_INCREF(item);
      int status = walk(w, item, depth + 1);
      Py_DECREF(item);
      if (status != 0) {
        return status;
      }
    }
    return 0;
  }
  if (type == &PyDict_Type) {
    PyObject* keys = PyDict_Keys(value);
    if (keys == nullptr) {
      return -1;
    }
    PyObject* key_tuple = PyList_AsTuple(keys);
    Py_DECREF(keys);
    if (key_tuple == nullptr) {
      return -1;
    }
    w.bytes.push_back(kDict);
    int appended = PyList_Append(w.objects, key_tuple);
    int status = appended < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; status == 0 && i < PyTuple_GET_SIZE(key_tuple);
         ++i) {
      PyObject* item = PyDict_GetItemWithError(value,
                                               PyTuple_GET_ITEM(key_tuple, i));
      if (item == nullptr) {
        status = PyErr_Occurred() ? -1 : 1;
        break;
      }
      Py_INCREF(item);
      status = walk(w, item, depth + 1);
      Py_DECREF(item);
    }
    Py_DECREF(key_tuple);
    return status;
  }
  for (int64_t index = 0; index < 5; ++index) {
    if (type == kConstantTypes[index]) {
      w.bytes.push_back(kConstant);
      w.bytes.push_back(index);
      if (PyList_Append(w.leaves, value) < 0 ||
          PyList_Append(w.objects, value) < 0) {
        return -1;
      }
      return 0;
    }
  }
  if (object_constant_types != nullptr) {
    for (Py_ssize_t index = 0; index < PyTuple_GET_SIZE(object_constant_types);
         ++index) {
      if ((PyObject*)type == PyTuple_GET_ITEM(object_constant_types, index)) {
        w.bytes.push_back(kConstant);
        w.bytes.push_back(5 + index);
        if (PyList_Append(w.leaves, value) < 0 ||
            PyList_Append(w.objects, value) < 0) {
          return -1;
        }
        return 0;
      }
    }
  }
  // An object argument: its class, its attributes' names and values (see
  // [Note: Objects in a call] in call_spec.py).
  int keyed = is_keyed_object(type);
  if (keyed <= 0) {
    return keyed < 0 ? -1 : 1;
  }
  PyObject* attributes = PyObject_GetAttrString(value, "__dict__");
  if (attributes == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      return -1;
    }
    PyErr_Clear();
    return 1;
  }
  if (!PyDict_CheckExact(attributes)) {
    Py_DECREF(attributes);
    return 1;
  }
  PyObject* names = PyDict_Keys(attributes);
  PyObject* values = names == nullptr ? nullptr : PyDict_Values(attributes);
  Py_DECREF(attributes);
  PyObject* name_tuple = names == nullptr ? nullptr : PyList_AsTuple(names);
  Py_XDECREF(names);
  if (values == nullptr || name_tuple == nullptr) {
    Py_XDECREF(values);
    Py_XDECREF(name_tuple);
    return -1;
  }
  w.bytes.push_back(kObject);
  int status = (PyList_Append(w.leaves, value) < 0 ||
                PyList_Append(w.objects, (PyObject*)type) < 0 ||
                PyList_Append(w.objects, name_tuple) < 0)
                   ? -1
                   : 0;
  Py_DECREF(name_tuple);
  // `values` holds the attributes' values while they are walked.
  for (Py_ssize_t i = 0; status == 0 && i < PyList_GET_SIZE(values); ++i) {
    status = walk(w, PyList_GET_ITEM(values, i), depth + 1);
  }
  Py_DECREF(values);
  return status;
}

bool has_repeated_tensor(const std::vector<PyObject*>& tensors) {
  if (tensors.size() > 32) {
    std::unordered_set<PyObject*> seen(tensors.begin(), tensors.end());
    return seen.size() != tensors.size();
  }
  for (size_t i = 1; i < tensors.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (tensors[i] == tensors[j]) {
        return true;
      }
    }
  }
  return false;
}

// call_key(args: tuple, kwargs: dict, sharding_of, object_keying)
//     -> (key | None, leaves)
PyObject* call_key(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1]) ||
      !PyTuple_Check(argv[3]) || PyTuple_GET_SIZE(argv[3]) != 3 ||
      !PyDict_Check(PyTuple_GET_ITEM(argv[3], 0)) ||
      !PyTuple_Check(PyTuple_GET_ITEM(argv[3], 2))) {
    PyErr_SetString(PyExc_TypeError,
                    "call_key(args: tuple, kwargs: dict, sharding_of, "
                    "(keyed_object_types: dict, is_keyed_object, "
                    "object_constant_types: tuple))");
    return nullptr;
  }
  keyed_object_types = PyTuple_GET_ITEM(argv[3], 0);
  is_keyed_object_fn = PyTuple_GET_ITEM(argv[3], 1);
  object_constant_types = PyTuple_GET_ITEM(argv[3], 2);
  PyObject* args = argv[0];
  PyObject* kwargs = argv[1];
  KeyWalk w;
  w.sharding_of = argv[2];
  w.objects = PyList_New(0);
  w.leaves = PyList_New(0);
  if (w.objects == nullptr || w.leaves == nullptr) {
    Py_XDECREF(w.objects);
    Py_XDECREF(w.leaves);
    return nullptr;
  }
  int status = walk(w, args, 0);
  if (status == 0 && PyDict_GET_SIZE(kwargs) > 0) {
    PyObject* names = PyDict_Keys(kwargs);
    if (names == nullptr || PyList_Sort(names) < 0) {
      status = -1;
    } else {
      PyObject* name_tuple = PyList_AsTuple(names);
      w.bytes.push_back(kKeywords);
      if (name_tuple == nullptr || PyList_Append(w.objects, name_tuple) < 0) {
        status = -1;
      }
      for (Py_ssize_t i = 0; status == 0 && i < PyTuple_GET_SIZE(name_tuple);
           ++i) {
        PyObject* item =
            PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(name_tuple, i));
        if (item == nullptr) {
          status = PyErr_Occurred() ? -1 : 1;
          break;
        }
        Py_INCREF(item);
        status = walk(w, item, 1);
        Py_DECREF(item);
      }
      Py_XDECREF(name_tuple);
    }
    Py_XDECREF(names);
  }
  if (status < 0) {
    Py_DECREF(w.objects);
    Py_DECREF(w.leaves);
    return nullptr;
  }
  PyObject* key = nullptr;
  if (status == 0 && !has_repeated_tensor(w.tensors)) {
    Py_ssize_t count = PyList_GET_SIZE(w.objects);
    key = PyTuple_New(count + 1);
    PyObject* bytes = PyBytes_FromStringAndSize(
        reinterpret_cast<const char*>(w.bytes.data()),
        static_cast<Py_ssize_t>(w.bytes.size() * sizeof(int64_t)));
    if (key == nullptr || bytes == nullptr) {
      Py_XDECREF(key);
      Py_XDECREF(bytes);
      Py_DECREF(w.objects);
      Py_DECREF(w.leaves);
      return nullptr;
    }
    PyTuple_SET_ITEM(key, 0, bytes);
    for (Py_ssize_t i = 0; i < count; ++i) {
      PyObject* item = PyList_GET_ITEM(w.objects, i);
      Py_INCREF(item);
      PyTuple_SET_ITEM(key, i + 1, item);
    }
  } else {
    key = Py_None;
    Py_INCREF(key);
  }
  Py_DECREF(w.objects);
  PyObject* result = PyTuple_Pack(2, key, w.leaves);
  Py_DECREF(key);
  Py_DECREF(w.leaves);
  return result;
}

// metadata(tensors: sequence) -> bytes: each tensor's dtype, device, sizes
// and strides.
PyObject* metadata(PyObject*, PyObject* tensors) {
  PyObject* sequence = PySequence_Fast(tensors, "metadata(tensors)");
  if (sequence == nullptr) {
    return nullptr;
  }
  std::vector<int64_t> bytes;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(sequence, i);
    if (!THPVariable_Check(item)) {
      Py_DECREF(sequence);
      PyErr_SetString(PyExc_TypeError, "metadata() takes tensors");
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(item);
    bytes.push_back(static_cast<int64_t>(tensor.scalar_type()));
    bytes.push_back(static_cast<int64_t>(tensor.device().type()));
    bytes.push_back(static_cast<int64_t>(tensor.device().index()));
    try {
      at::IntArrayRef sizes = tensor.sizes();
      at::IntArrayRef strides = tensor.strides();
      bytes.push_back(static_cast<int64_t>(sizes.size()));
      bytes.insert(bytes.end(), sizes.begin(), sizes.end());
      bytes.insert(bytes.end(), strides.begin(), strides.end());
    } catch (const std::exception&) {
      // Symbolic or no sizes: never equal to a concrete tensor's metadata.
      bytes.push_back(-1);
    }
  }
  Py_DECREF(sequence);
  return PyBytes_FromStringAndSize(
      reinterpret_cast<const char*>(bytes.data()),
      static_cast<Py_ssize_t>(bytes.size() * sizeof(int64_t)));
}

// metadata_matches(tensors: sequence, packed: bytes) -> bool: whether
// metadata(tensors) would equal `packed`, read in place: no buffer made,
// and the first difference ends the walk. A served call makes this check
// on every bound tensor (see BoundTensorCheck in call_plan.py).
PyObject* metadata_matches(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyBytes_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "metadata_matches(tensors, packed)");
    return nullptr;
  }
  PyObject* sequence = PySequence_Fast(argv[0], "metadata_matches(tensors)");
  if (sequence == nullptr) {
    return nullptr;
  }
  const int64_t* packed =
      reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(argv[1]));
  const Py_ssize_t length =
      PyBytes_GET_SIZE(argv[1]) / static_cast<Py_ssize_t>(sizeof(int64_t));
  Py_ssize_t at = 0;
  bool same = true;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
  for (Py_ssize_t i = 0; same && i < count; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(sequence, i);
    if (!THPVariable_Check(item)) {
      Py_DECREF(sequence);
      PyErr_SetString(PyExc_TypeError, "metadata_matches() takes tensors");
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(item);
    if (length - at < 4 ||
        packed[at] != static_cast<int64_t>(tensor.scalar_type()) ||
        packed[at + 1] != static_cast<int64_t>(tensor.device().type()) ||
        packed[at + 2] != static_cast<int64_t>(tensor.device().index())) {
      same = false;
      break;
    }
    at += 3;
    try {
      at::IntArrayRef sizes = tensor.sizes();
      const int64_t rank = static_cast<int64_t>(sizes.size());
      if (packed[at] != rank || length - at < 1 + 2 * rank) {
        same = false;
        break;
      }
      at += 1;
      for (int64_t d = 0; d < rank; ++d) {
        same = same && packed[at + d] == sizes[d];
      }
      at += rank;
      at::IntArrayRef strides = tensor.strides();
      for (int64_t d = 0; d < rank; ++d) {
        same = same && packed[at + d] == strides[d];
      }
      at += rank;
    } catch (const std::exception&) {
      // As metadata() packs a tensor without concrete sizes.
      same = length - at >= 1 && packed[at] == -1;
      at += 1;
    }
  }
  Py_DECREF(sequence);
  if (same && at == length) {
    Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

// init(data_id, tensor_id): torch_xla's `_unique_id_for_ir_and_data` and
// `_xla_get_tensor_id`.
PyObject* init(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2) {
    PyErr_SetString(PyExc_TypeError, "init(data_id, tensor_id)");
    return nullptr;
  }
  Py_XSETREF(data_id_fn, Py_NewRef(argv[0]));
  Py_XSETREF(tensor_id_fn, Py_NewRef(argv[1]));
  Py_RETURN_NONE;
}

bool ready() {
  if (data_id_fn == nullptr || tensor_id_fn == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "fast_path.init() was not called");
    return false;
  }
  return true;
}

// torch_xla names a tensor by its IR node and output index while it has one
// ("<node>, <index>"), else by its device data.
int was_read(PyObject* data_id) {
  return PyUnicode_FindChar(data_id, ',', 0, PyUnicode_GET_LENGTH(data_id), 1) >=
         0;
}

// read_donations(tensors, data_ids | None, copy_if_read, ledger)
//   -> (indices that may be held elsewhere and to copy, whether to sync the
//       device's readers)
// donation.read_donations' decision; the ledger's entries of the
// tensors are forgotten.
PyObject* read_donations(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4 || !PyList_Check(argv[0]) || !PyList_Check(argv[2]) ||
      !PyDict_Check(argv[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "read_donations(tensors: list, data_ids: list | None, "
                    "copy_if_read: list, ledger: dict)");
    return nullptr;
  }
  if (!ready()) {
    return nullptr;
  }
  PyObject* tensors = argv[0];
  PyObject* data_ids = argv[1];
  PyObject* copy_if_read = argv[2];
  PyObject* ledger = argv[3];
  Py_ssize_t count = PyList_GET_SIZE(tensors);
  if (PyList_GET_SIZE(copy_if_read) != count ||
      (data_ids != Py_None &&
       (!PyList_Check(data_ids) || PyList_GET_SIZE(data_ids) != count))) {
    PyErr_SetString(PyExc_TypeError,
                    "read_donations: data_ids and copy_if_read need one item "
                    "per tensor");
    return nullptr;
  }
  PyObject* read = PyList_New(0);
  if (read == nullptr) {
    return nullptr;
  }
  bool sync_readers = false;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* tensor = PyList_GET_ITEM(tensors, i);
    PyObject* data_id = data_ids == Py_None
                            ? PyObject_CallOneArg(data_id_fn, tensor)
                            : Py_NewRef(PyList_GET_ITEM(data_ids, i));
    if (data_id == nullptr) {
      Py_DECREF(read);
      return nullptr;
    }
    if (!PyUnicode_Check(data_id)) {
      Py_DECREF(data_id);
      Py_DECREF(read);
      PyErr_SetString(PyExc_TypeError, "read_donations: a data id is a str");
      return nullptr;
    }
    // 1 given, -1 given but reads leave no trace on it, 0 may be held
    // elsewhere (read, or data the ledger does not vouch for).
    bool has_ir = was_read(data_id);
    int given = 0;
    PyObject* id = PyObject_CallOneArg(tensor_id_fn, tensor);
    if (id == nullptr) {
      Py_DECREF(data_id);
      Py_DECREF(read);
      return nullptr;
    }
    PyObject* known = PyDict_GetItemWithError(ledger, id);
    if (known != nullptr) {
      Py_INCREF(known);
      if (PyDict_DelItem(ledger, id) < 0) {
        Py_DECREF(known);
        known = nullptr;
      }
    }
    Py_DECREF(id);
    if (known == nullptr && PyErr_Occurred()) {
      Py_DECREF(data_id);
      Py_DECREF(read);
      return nullptr;
    }
    if (known != nullptr) {
      int same =
          PyObject_RichCompareBool(PyTuple_GET_ITEM(known, 0), data_id, Py_EQ);
      if (same < 0) {
        Py_DECREF(known);
        Py_DECREF(data_id);
        Py_DECREF(read);
        return nullptr;
      }
      if (same) {
        // Given data that came in an IR node of its own (SPMD): reads leave
        // no trace on it.
        given = !PyObject_IsTrue(PyTuple_GET_ITEM(known, 1)) ? 0
                : has_ir                                     ? -1
                                                             : 1;
      }
      Py_DECREF(known);
    }
    Py_DECREF(data_id);
    if (given == 1) {
      continue;
    }
    if (given == 0 && PyObject_IsTrue(PyList_GET_ITEM(copy_if_read, i))) {
      PyObject* index = PyLong_FromSsize_t(i);
      if (index == nullptr || PyList_Append(read, index) < 0) {
        Py_XDECREF(index);
        Py_DECREF(read);
        return nullptr;
      }
      Py_DECREF(index);
    } else {
      sync_readers = true;
    }
  }
  PyObject* result = PyTuple_Pack(2, read, sync_readers ? Py_True : Py_False);
  Py_DECREF(read);
  return result;
}

// Notes `result`'s data as given in the ledger (donation.note_data).
bool note_given(PyObject* result, PyObject* ledger, Py_ssize_t limit) {
  PyObject* id = PyObject_CallOneArg(tensor_id_fn, result);
  if (id == nullptr) {
    return false;
  }
  PyObject* data_id = PyObject_CallOneArg(data_id_fn, result);
  if (data_id == nullptr) {
    Py_DECREF(id);
    return false;
  }
  PyObject* entry = PyTuple_Pack(2, data_id, Py_True);
  Py_DECREF(data_id);
  int status = entry == nullptr ? -1 : PyDict_SetItem(ledger, id, entry);
  Py_XDECREF(entry);
  Py_DECREF(id);
  if (status < 0) {
    return false;
  }
  if (PyDict_GET_SIZE(ledger) > limit) {
    Py_ssize_t position = 0;
    PyObject* oldest;
    PyObject* ignored;
    if (PyDict_Next(ledger, &position, &oldest, &ignored)) {
      Py_INCREF(oldest);
      status = PyDict_DelItem(ledger, oldest);
      Py_DECREF(oldest);
      if (status < 0) {
        return false;
      }
    }
  }
  return true;
}

// take_results(targets, results, drop_update_log, ledger, limit) -> None
// donation.take_result of each (target, result) pair.
PyObject* take_results(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 5 || !PyList_Check(argv[0]) || !PyList_Check(argv[1]) ||
      !PyDict_Check(argv[3]) ||
      PyList_GET_SIZE(argv[0]) != PyList_GET_SIZE(argv[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "take_results(targets: list, results: list of the same "
                    "length, drop_update_log: bool, ledger: dict, limit: int)");
    return nullptr;
  }
  if (!ready()) {
    return nullptr;
  }
  PyObject* targets = argv[0];
  PyObject* results = argv[1];
  int drop_update_log = PyObject_IsTrue(argv[2]);
  PyObject* ledger = argv[3];
  Py_ssize_t limit = PyLong_AsSsize_t(argv[4]);
  if (drop_update_log < 0 || (limit == -1 && PyErr_Occurred())) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(targets); ++i) {
    PyObject* target_object = PyList_GET_ITEM(targets, i);
    PyObject* result_object = PyList_GET_ITEM(results, i);
    if (!THPVariable_Check(target_object) || !THPVariable_Check(result_object)) {
      PyErr_SetString(PyExc_TypeError, "take_results() takes tensors");
      return nullptr;
    }
    const at::Tensor& target = THPVariable_Unpack(target_object);
    const at::Tensor& result = THPVariable_Unpack(result_object);
    try {
      if (!at::functionalization::impl::isFunctionalTensor(target)) {
        // XLA_DISABLE_FUNCTIONALIZATION=1: a lazy tensor of its own.
        target.copy_(result);
        continue;
      }
      at::functionalization::impl::replace_(
          target, at::functionalization::impl::from_functional_tensor(result));
      at::functionalization::impl::commit_update(target);
      if (drop_update_log) {
        at::functionalization::impl::sync(target);
      }
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
    if (!note_given(result_object, ledger, limit)) {
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

// [Note: Counters made once]
// torch_xla's `_xla_increment_counter` makes a torch::lazy::Counter for each
// bump and never frees it (64 bytes a bump in 2.8 and 2.9), and a Counter
// looks its name up in the metrics arena, under the arena's mutex, on its
// first bump. The bridge bumps a counter on every call it serves. Here a
// name gets one Counter for the process, found again by the name's str
// object (held, so its address names it alone), or by its text past
// kMaxNameObjects objects. Its bumps land in the arena's entry for the name,
// the one torch_xla's bindings bump: torch_xla.debug.metrics reads one count,
// and clear_counters() resets it. Called with the GIL held, which guards the
// maps.
constexpr size_t kMaxNameObjects = 1024;
std::unordered_map<PyObject*, torch::lazy::Counter*> counter_of_name_object;
std::unordered_map<std::string, torch::lazy::Counter*> counter_of_name;

// increment_counter(name: str, value: int): torch_xla's counter `name` grows
// by `value`, as `_xla_increment_counter(name, value)` would.
PyObject* increment_counter(PyObject*, PyObject* const* argv,
                            Py_ssize_t argc) {
  if (argc != 2 || !PyUnicode_Check(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "increment_counter(name: str, value)");
    return nullptr;
  }
  const long long value = PyLong_AsLongLong(argv[1]);
  if (value == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  torch::lazy::Counter* counter = nullptr;
  auto found = counter_of_name_object.find(argv[0]);
  if (found != counter_of_name_object.end()) {
    counter = found->second;
  } else {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(argv[0], &size);
    if (text == nullptr) {
      return nullptr;
    }
    const std::string name(text, static_cast<size_t>(size));
    torch::lazy::Counter*& made = counter_of_name[name];
    if (made == nullptr) {
      // Kept for the process, as the arena keeps its entry.
      made = new torch::lazy::Counter(name);
    }
    counter = made;
    if (counter_of_name_object.size() < kMaxNameObjects) {
      counter_of_name_object.emplace(Py_NewRef(argv[0]), counter);
    }
  }
  counter->AddValue(static_cast<int64_t>(value));
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"call_key", reinterpret_cast<PyCFunction>(call_key), METH_FASTCALL,
     "(key | None, leaves) of a call (call_spec.call_key)."},
    {"metadata", metadata, METH_O,
     "Each tensor's dtype, device, sizes and strides, as bytes."},
    {"init", reinterpret_cast<PyCFunction>(init), METH_FASTCALL,
     "Sets torch_xla's data id and tensor id functions."},
    {"metadata_matches", reinterpret_cast<PyCFunction>(metadata_matches),
     METH_FASTCALL, "Whether metadata(tensors) equals the packed bytes."},
    {"read_donations", reinterpret_cast<PyCFunction>(read_donations),
     METH_FASTCALL, "donation.read_donations' decision."},
    {"take_results", reinterpret_cast<PyCFunction>(take_results),
     METH_FASTCALL, "donation.take_result of each pair."},
    {"increment_counter", reinterpret_cast<PyCFunction>(increment_counter),
     METH_FASTCALL, "torch_xla's counter `name` grows by `value`."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fast_path",
                          "The served call's per-call work in C++.", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit__fast_path() {
  return PyModule_Create(&module_def);
}
