/* FLAME's CuPy allocator (flame_core/memory/cuda.py) in C: part of flame_core._speedups.

CuPy's PythonFunctionAllocator keeps the free function on its memory object, a Cython class that the garbage
collector tracks. When the collector frees a reference cycle that holds arrays, it may clear that object's fields
before the object dies (it clears the cycle's objects one by one, in the order it found them); the object's
__dealloc__ then calls None, the TypeError is printed as ignored and the block never returns to FLAME's pool.

`Allocator(malloc_func, free_func, get_device_id, unowned_memory, memory_pointer).malloc` is that allocator's malloc
with the free held by a `BlockOwner` instead: a small object the collector does not track (it holds only the free
function and two ints, so it is never inside a cycle), referenced by a CuPy UnownedMemory. Whatever ends the
UnownedMemory -- its last reference, or the collector clearing its owner field -- drops the BlockOwner, whose dealloc
returns the block. Statement for statement (CuPy's PythonFunctionAllocator.malloc and PythonFunctionAllocatorMemory,
with the free moved to the owner):

    def malloc(self, size):
        device_id = self.get_device_id()
        if size == 0:                      # CuPy's: no call to malloc_func, a null pointer
            return self.memory_pointer(self.unowned_memory(0, 0, None, device_id), 0)
        ptr = self.malloc_func(size, device_id)
        owner = BlockOwner(self.free_func, ptr, device_id)   # its dealloc: free_func(ptr, device_id)
        return self.memory_pointer(self.unowned_memory(ptr, size, owner, device_id), 0)

A free function that raises is reported as unraisable (as CuPy's __dealloc__ does) and an exception in flight when the
owner dies is kept. tests/memory/test_alloc_owner.py checks it on the CPU with stand-ins for CuPy's classes;
tests/memory/test_cuda_pool.py on the GPU, with a cycle that CuPy's allocator loses. */
#include "speedups.h"
#include "structmember.h"

/* ---- BlockOwner: returns one block when it dies; not tracked by the garbage collector ---- */

typedef struct {
    PyObject_HEAD PyObject *free_func;
    PyObject *ptr;
    PyObject *device_id;
} BlockOwner;

static void owner_dealloc(PyObject *o) {
    BlockOwner *self = (BlockOwner *)o;
    PyObject *et, *ev, *tb, *args[2], *r;
    PyErr_Fetch(&et, &ev, &tb);
    args[0] = self->ptr;
    args[1] = self->device_id;
    r = PyObject_Vectorcall(self->free_func, args, 2, NULL);
    if (r == NULL)
        PyErr_WriteUnraisable(self->free_func);
    else
        Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    Py_DECREF(self->free_func);
    Py_DECREF(self->ptr);
    Py_DECREF(self->device_id);
    Py_TYPE(o)->tp_free(o);
}

static PyObject *owner_make(PyTypeObject *type, PyObject *free_func, PyObject *ptr, PyObject *device_id) {
    BlockOwner *self = (BlockOwner *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(free_func);
    Py_INCREF(ptr);
    Py_INCREF(device_id);
    self->free_func = free_func;
    self->ptr = ptr;
    self->device_id = device_id;
    return (PyObject *)self;
}

static PyTypeObject BlockOwnerType;

/* BlockOwner(free_func, ptr, device_id) */
static PyObject *owner_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *free_func, *ptr, *device_id;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "BlockOwner(free_func, ptr, device_id) takes no keywords");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "BlockOwner", 3, 3, &free_func, &ptr, &device_id))
        return NULL;
    if (!PyCallable_Check(free_func)) {
        PyErr_SetString(PyExc_TypeError, "BlockOwner: free_func is not callable");
        return NULL;
    }
    return owner_make(type, free_func, ptr, device_id);
}

static PyObject *owner_repr(PyObject *o) {
    BlockOwner *self = (BlockOwner *)o;
    return PyUnicode_FromFormat("<BlockOwner ptr=%R device_id=%R>", self->ptr, self->device_id);
}

static PyMemberDef owner_members[] = {
    {"ptr", T_OBJECT_EX, offsetof(BlockOwner, ptr), READONLY, "the block's address"},
    {"device_id", T_OBJECT_EX, offsetof(BlockOwner, device_id), READONLY, "its device"},
    {NULL, 0, 0, 0, NULL}};

static PyTypeObject BlockOwnerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flame_core._speedups.BlockOwner",
    .tp_basicsize = sizeof(BlockOwner),
    .tp_dealloc = owner_dealloc,
    .tp_repr = owner_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Py_TPFLAGS_HAVE_GC: the collector neither tracks nor clears it */
    .tp_doc = "BlockOwner(free_func, ptr, device_id): calls free_func(ptr, device_id) when it dies.",
    .tp_members = owner_members,
    .tp_new = owner_new,
};

/* ---- Allocator: CuPy's PythonFunctionAllocator with the free on a BlockOwner ---- */

typedef struct {
    PyObject_HEAD PyObject *malloc_func;
    PyObject *free_func;
    PyObject *get_device_id;
    PyObject *unowned_memory;
    PyObject *memory_pointer;
} Allocator;

static PyObject *zero; /* the int 0 */

/* malloc(size) -> memory_pointer(unowned_memory(ptr, size, owner, device_id), 0) */
static PyObject *allocator_malloc(PyObject *o, PyObject *size) {
    Allocator *self = (Allocator *)o;
    PyObject *device_id, *ptr = NULL, *owner = NULL, *mem = NULL, *out = NULL, *args[4];
    Py_ssize_t n = PyLong_AsSsize_t(size);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if ((device_id = PyObject_CallNoArgs(self->get_device_id)) == NULL)
        return NULL;
    if (n == 0) {
        args[0] = zero;
        args[1] = zero;
        args[2] = Py_None;
        args[3] = device_id;
    } else {
        args[0] = size;
        args[1] = device_id;
        if ((ptr = PyObject_Vectorcall(self->malloc_func, args, 2, NULL)) == NULL)
            goto done;
        if ((owner = owner_make(&BlockOwnerType, self->free_func, ptr, device_id)) == NULL) {
            PyObject *et, *ev, *tb, *r; /* (the host's memory ran out) the block goes back, the error stays */
            PyErr_Fetch(&et, &ev, &tb);
            args[0] = ptr;
            r = PyObject_Vectorcall(self->free_func, args, 2, NULL);
            if (r == NULL)
                PyErr_WriteUnraisable(self->free_func);
            Py_XDECREF(r);
            PyErr_Restore(et, ev, tb);
            goto done;
        }
        args[0] = ptr;
        args[1] = size;
        args[2] = owner;
        args[3] = device_id;
    }
    if ((mem = PyObject_Vectorcall(self->unowned_memory, args, 4, NULL)) == NULL)
        goto done; /* (owner dies below and returns the block) */
    args[0] = mem;
    args[1] = zero;
    out = PyObject_Vectorcall(self->memory_pointer, args, 2, NULL);
done:
    Py_XDECREF(mem);
    Py_XDECREF(owner);
    Py_XDECREF(ptr);
    Py_DECREF(device_id);
    return out;
}

static int allocator_traverse(PyObject *o, visitproc visit, void *arg) {
    Allocator *self = (Allocator *)o;
    Py_VISIT(self->malloc_func);
    Py_VISIT(self->free_func);
    Py_VISIT(self->get_device_id);
    Py_VISIT(self->unowned_memory);
    Py_VISIT(self->memory_pointer);
    return 0;
}

static int allocator_clear(PyObject *o) {
    Allocator *self = (Allocator *)o;
    Py_CLEAR(self->malloc_func);
    Py_CLEAR(self->free_func);
    Py_CLEAR(self->get_device_id);
    Py_CLEAR(self->unowned_memory);
    Py_CLEAR(self->memory_pointer);
    return 0;
}

static void allocator_dealloc(PyObject *o) {
    PyObject_GC_UnTrack(o);
    allocator_clear(o);
    Py_TYPE(o)->tp_free(o);
}

/* Allocator(malloc_func, free_func, get_device_id, unowned_memory, memory_pointer) */
static PyObject *allocator_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"malloc_func", "free_func", "get_device_id", "unowned_memory", "memory_pointer", NULL};
    PyObject *f[5];
    Allocator *self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO:Allocator", kw, &f[0], &f[1], &f[2], &f[3], &f[4]))
        return NULL;
    for (int i = 0; i < 5; i++)
        if (!PyCallable_Check(f[i])) {
            PyErr_Format(PyExc_TypeError, "Allocator: %s is not callable", kw[i]);
            return NULL;
        }
    if ((self = (Allocator *)type->tp_alloc(type, 0)) == NULL)
        return NULL;
    for (int i = 0; i < 5; i++)
        Py_INCREF(f[i]);
    self->malloc_func = f[0];
    self->free_func = f[1];
    self->get_device_id = f[2];
    self->unowned_memory = f[3];
    self->memory_pointer = f[4];
    return (PyObject *)self;
}

static PyMethodDef allocator_methods[] = {
    {"malloc", allocator_malloc, METH_O, "malloc(size): a MemoryPointer over a block that a BlockOwner returns."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject AllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flame_core._speedups.Allocator",
    .tp_basicsize = sizeof(Allocator),
    .tp_dealloc = allocator_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Allocator(malloc_func, free_func, get_device_id, unowned_memory, memory_pointer): CuPy's "
              "PythonFunctionAllocator with each block's free held by a BlockOwner (flame_core/csrc/alloc.c).",
    .tp_traverse = allocator_traverse,
    .tp_clear = allocator_clear,
    .tp_methods = allocator_methods,
    .tp_new = allocator_new,
};

int alloc_init(void) {
    if ((zero = PyLong_FromLong(0)) == NULL)
        return -1;
    if (PyType_Ready(&BlockOwnerType) < 0 || PyType_Ready(&AllocatorType) < 0)
        return -1;
    return 0;
}

int alloc_add_types(PyObject *m) {
    Py_INCREF(&BlockOwnerType);
    if (PyModule_AddObject(m, "BlockOwner", (PyObject *)&BlockOwnerType) < 0) {
        Py_DECREF(&BlockOwnerType);
        return -1;
    }
    Py_INCREF(&AllocatorType);
    if (PyModule_AddObject(m, "Allocator", (PyObject *)&AllocatorType) < 0) {
        Py_DECREF(&AllocatorType);
        return -1;
    }
    return 0;
}
