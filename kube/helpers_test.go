package kube

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	k8stesting "k8s.io/client-go/testing"
)

var cmGVR = corev1.SchemeGroupVersion.WithResource("configmaps")

// casFake is a fake clientset whose ConfigMaps behave like the API
// server's: every write gets a new resourceVersion, and an update whose
// resourceVersion is not the stored one fails with Conflict. (The fake's
// object tracker alone accepts any update.)
type casFake struct {
	*fake.Clientset
	mu sync.Mutex
	rv int64
	// beforeUpdate, if set, runs before an update of a ConfigMap is
	// applied, with the tracker: a test writes there as another router.
	beforeUpdate func(tr k8stesting.ObjectTracker, cm *corev1.ConfigMap)
}

func newCASFake(objs ...runtime.Object) *casFake {
	f := &casFake{Clientset: fake.NewClientset(objs...)}
	tr := f.Tracker()
	f.PrependReactor("create", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
		cm := a.(k8stesting.CreateAction).GetObject().(*corev1.ConfigMap).DeepCopy()
		if cm.ResourceVersion != "" {
			return true, nil, apierrors.NewBadRequest("resourceVersion should not be set on objects to be created")
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		f.rv++
		cm.ResourceVersion = strconv.FormatInt(f.rv, 10)
		if err := tr.Create(cmGVR, cm, a.GetNamespace()); err != nil {
			return true, nil, err
		}
		return true, cm, nil
	})
	f.PrependReactor("update", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
		cm := a.(k8stesting.UpdateAction).GetObject().(*corev1.ConfigMap).DeepCopy()
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.beforeUpdate != nil {
			hook := f.beforeUpdate
			f.beforeUpdate = nil
			hook(tr, cm)
		}
		cur, err := tr.Get(cmGVR, a.GetNamespace(), cm.Name)
		if err != nil {
			return true, nil, err
		}
		if cur.(*corev1.ConfigMap).ResourceVersion != cm.ResourceVersion {
			return true, nil, apierrors.NewConflict(cmGVR.GroupResource(), cm.Name,
				errors.New("the object has been modified; please apply your changes to the latest version and try again"))
		}
		f.rv++
		cm.ResourceVersion = strconv.FormatInt(f.rv, 10)
		if err := tr.Update(cmGVR, cm, a.GetNamespace()); err != nil {
			return true, nil, err
		}
		return true, cm, nil
	})
	return f
}

// bumpRV stores cm in the tracker with a new resourceVersion (the caller
// holds f.mu, as beforeUpdate hooks do).
func (f *casFake) bumpRVLocked(tr k8stesting.ObjectTracker, cm *corev1.ConfigMap) {
	f.rv++
	cm.ResourceVersion = strconv.FormatInt(f.rv, 10)
	if err := tr.Update(cmGVR, cm, cm.Namespace); err != nil {
		panic(err)
	}
}

// putConfigMap creates the weft ConfigMap with data.
func (f *casFake) putConfigMap(t *testing.T, data map[string]string) {
	t.Helper()
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: DefaultConfigMapName, Namespace: DefaultNamespace}, Data: data}
	if _, err := f.CoreV1().ConfigMaps(DefaultNamespace).Create(context.Background(), cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// configMap reads the weft ConfigMap's data (nil if it does not exist).
func (f *casFake) configMap(t *testing.T) map[string]string {
	t.Helper()
	cm, err := f.CoreV1().ConfigMaps(DefaultNamespace).Get(context.Background(), DefaultConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return cm.Data
}

// failN makes the first n calls of verb on resource fail with err.
func (f *casFake) failN(verb, resource string, n int, err error) *int {
	count := new(int)
	f.PrependReactor(verb, resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		if *count >= n { // the fake serializes reactors under its lock
			return false, nil, nil
		}
		*count++
		return true, nil, err
	})
	return count
}

// countActions counts the recorded actions of verb on resource.
func (f *casFake) countActions(verb, resource string) int {
	n := 0
	for _, a := range f.Actions() {
		if a.GetVerb() == verb && a.GetResource().Resource == resource {
			n++
		}
	}
	return n
}

func node(name string, addrs ...corev1.NodeAddress) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.NodeStatus{Addresses: addrs}}
}

func internal(a string) corev1.NodeAddress {
	return corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: a}
}

func external(a string) corev1.NodeAddress {
	return corev1.NodeAddress{Type: corev1.NodeExternalIP, Address: a}
}

// logBuf collects log lines for assertions; safe for concurrent use.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// count is the number of lines that contain s.
func (l *logBuf) count(s string) int {
	n := 0
	for _, line := range strings.Split(l.String(), "\n") {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// delays records the waits asked of the injected timer, which fires at
// once.
type delays struct {
	mu sync.Mutex
	d  []time.Duration
}

func (d *delays) after(x time.Duration) <-chan time.Time {
	d.mu.Lock()
	d.d = append(d.d, x)
	d.mu.Unlock()
	ch := make(chan time.Time, 1)
	ch <- time.Time{}
	return ch
}

func (d *delays) get() []time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]time.Duration(nil), d.d...)
}

// testKube is a Kube over f for a node, with a captured log, an instant
// timer and a seeded jitter source.
type testKube struct {
	*Kube
	log    *logBuf
	delays *delays
}

func newTestKube(t *testing.T, f *casFake, nodeName, peer string, mod ...func(*Config)) *testKube {
	t.Helper()
	lb := &logBuf{}
	d := &delays{}
	seed := uint64(time.Now().UnixNano())
	t.Logf("kube %s: jitter seed %d", nodeName, seed)
	cfg := Config{
		Client:   f,
		NodeName: nodeName,
		PeerName: peer,
		Nickname: nodeName,
		Logger:   slog.New(slog.NewTextHandler(lb, &slog.HandlerOptions{Level: slog.LevelDebug})).With("self", peer),
		After:    d.after,
		Rand:     rand.New(rand.NewPCG(seed, seed)),
	}
	for _, m := range mod {
		m(&cfg)
	}
	k, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of %s:\n%s", nodeName, lb.String())
		}
	})
	return &testKube{Kube: k, log: lb, delays: d}
}

// run starts k.Run until the test ends, and waits for the node list.
func (k *testKube) run(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- k.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("Run did not return within 10s of its context's end")
			}
		})
	}
	t.Cleanup(stop)
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if err := k.WaitSynced(wctx); err != nil {
		t.Fatal(err)
	}
	return stop
}

// eventually polls cond until it holds or 10 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// recorder is a Reclaim callback that records its calls.
type recorder struct {
	mu    sync.Mutex
	calls []string
	fail  map[string]int // peer -> calls left that fail
}

func (r *recorder) reclaim(_ context.Context, peer string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, peer)
	if r.fail[peer] > 0 {
		r.fail[peer]--
		return fmt.Errorf("injected failure for %s", peer)
	}
	return nil
}

func (r *recorder) get() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

// UpdateBarrier is a client whose ConfigMap updates that match hold until
// n of them have arrived (or 5 s pass): n routers that read the same
// version then all write, and the compare-and-swap must pick one. (With
// the fake, the wait is outside its lock, which serializes its reactors.)
// Exported for the real-server tests of package kube_test.
type UpdateBarrier struct {
	kubernetes.Interface
	match   func(*corev1.ConfigMap) bool
	mu      sync.Mutex
	n       int
	allHere chan struct{}
}

// NewUpdateBarrier wraps c.
func NewUpdateBarrier(c kubernetes.Interface, n int, match func(*corev1.ConfigMap) bool) *UpdateBarrier {
	return &UpdateBarrier{Interface: c, match: match, n: n, allHere: make(chan struct{})}
}

// IsWatchListSemanticsUnSupported makes the informer list, then watch (the
// fake's answer; with a real server it only skips the streaming list).
func (b *UpdateBarrier) IsWatchListSemanticsUnSupported() bool { return true }

func (b *UpdateBarrier) CoreV1() typedcorev1.CoreV1Interface {
	return barrierCore{CoreV1Interface: b.Interface.CoreV1(), b: b}
}

func (b *UpdateBarrier) arrive(cm *corev1.ConfigMap) {
	if !b.match(cm) {
		return
	}
	b.mu.Lock()
	if b.n == 0 {
		b.mu.Unlock()
		return
	}
	b.n--
	if b.n == 0 {
		close(b.allHere)
	}
	b.mu.Unlock()
	select {
	case <-b.allHere:
	case <-time.After(5 * time.Second):
	}
}

type barrierCore struct {
	typedcorev1.CoreV1Interface
	b *UpdateBarrier
}

func (c barrierCore) ConfigMaps(ns string) typedcorev1.ConfigMapInterface {
	return barrierCMs{ConfigMapInterface: c.CoreV1Interface.ConfigMaps(ns), b: c.b}
}

type barrierCMs struct {
	typedcorev1.ConfigMapInterface
	b *UpdateBarrier
}

func (c barrierCMs) Update(ctx context.Context, cm *corev1.ConfigMap, opts metav1.UpdateOptions) (*corev1.ConfigMap, error) {
	c.b.arrive(cm)
	return c.ConfigMapInterface.Update(ctx, cm, opts)
}
