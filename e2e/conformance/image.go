package conformance

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/weft-net/weft/internal/ociimage"
)

// HostTools are the programs agnhost's upstream image (alpine) has that the
// sig-network tests run in its containers through `kubectl exec`: a shell,
// curl and nc above all (the dial helpers of test/e2e/framework/network),
// wget (the Services specs' reachability loops), ss and ip (NodePort checks),
// dig, nslookup and getent (the DNS and ExternalName specs' lookups),
// and the few utilities their shell lines use.
// The image takes them from this machine (Debian), with the shared libraries
// ldd lists for each: make conformance installs the packages (deps-conformance).
var HostTools = []string{
	"sh", "bash", "curl", "wget", "nc", "ss", "ip", "dig", "nslookup", "getent",
	"cat", "echo", "ls", "sleep", "timeout", "grep", "sed", "head", "tail", "wc", "tr",
	"date", "hostname", "env", "true", "false", "mkdir", "rm", "test", "seq", "cut", "printf",
	"id", "touch", "cp", "mv", "ln", "chmod", "stat", "uname", "dd", "sort", "uniq", "tee", "basename", "dirname",
}

// entry is one file of the image's layer.
type entry = ociimage.File

// ImageSpec is what AgnhostImage puts together.
type ImageSpec struct {
	Agnhost string // the static agnhost binary
	KubeSrc string // k8s.io/kubernetes' source: test/images/agnhost/porter's certificate
	// CoreDNS, if set, goes in as /coredns, as upstream's image has it:
	// the DNS specs run it in agnhost pods (BuildCoreDNS).
	CoreDNS string
	Tags    []string // the names e2e.test pulls it by
	Created time.Time
}

// AgnhostVersion reads test/images/agnhost/VERSION from the Kubernetes
// source: the version of the agnhost built from it.
func AgnhostVersion(kubeSrc string) (string, error) {
	data, err := os.ReadFile(filepath.Join(kubeSrc, "test", "images", "agnhost", "VERSION"))
	if err != nil {
		return "", fmt.Errorf("conformance: agnhost's version: %w", err)
	}
	v := strings.TrimSpace(string(data))
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+(\.[0-9]+)?$`).MatchString(v) {
		return "", fmt.Errorf("conformance: agnhost's VERSION %q is not a version", v)
	}
	return v, nil
}

// ImagesFor picks from e2e.test's --list-images output the names of the
// agnhost of version and of the pause image: those the suite pulls and the
// local images must carry. It fails when the list has no agnhost of that
// version (the e2e suite and agnhost source would not match).
func ImagesFor(list, version string) (agnhost, pause []string, err error) {
	for _, l := range strings.Fields(list) {
		repo, tag, ok := strings.Cut(l[strings.LastIndex(l, "/")+1:], ":")
		if !ok {
			continue
		}
		switch {
		case repo == "agnhost" && tag == version && strings.Contains(l, "e2e-test-images/"):
			agnhost = append(agnhost, l)
		case repo == "pause" && !strings.Contains(l, "invalid"):
			pause = append(pause, l)
		}
	}
	if len(agnhost) == 0 {
		return nil, nil, fmt.Errorf("conformance: e2e.test --list-images names no e2e-test-images/agnhost:%s (the agnhost source's VERSION); the suite and the source disagree", version)
	}
	return agnhost, pause, nil
}

// DNSTestingTools are what the DNS specs run in glibc-dns-testing: the
// shell loop of their probes (seq, test, echo, sleep), dig and getent.
var DNSTestingTools = []string{"sh", "bash", "dig", "getent", "seq", "test", "echo", "sleep", "cat", "ls", "grep", "mkdir", "rm"}

// GlibcDNSImage builds glibc-dns-testing's image as upstream's is made
// (Debian, dnsutils, /coredns): DNSTestingTools of this machine (Debian)
// with their libraries, and CoreDNS as /coredns. No entrypoint: the specs
// give the command. Written as a `docker save` tarball with tags.
func GlibcDNSImage(coredns string, tags []string, created time.Time, out string) error {
	files, err := glibcDNSFiles(coredns)
	if err != nil {
		return err
	}
	return writeImage(out, files, tags, created,
		"weft e2e/conformance: glibc-dns-testing from the build host's dnsutils and the pinned CoreDNS",
		v1.Config{
			Cmd:        []string{"/bin/sh"},
			Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			WorkingDir: "/",
		})
}

func glibcDNSFiles(coredns string) ([]entry, error) {
	bin, err := os.ReadFile(coredns)
	if err != nil {
		return nil, fmt.Errorf("conformance: %w", err)
	}
	files := []entry{
		{Path: "coredns", Mode: 0o755, Data: bin},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
		{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")},
		{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
		{Path: "etc/nsswitch.conf", Mode: 0o644, Data: []byte("hosts: files dns\npasswd: files\ngroup: files\n")},
	}
	host, err := hostFiles(DNSTestingTools)
	if err != nil {
		return nil, err
	}
	return dedupe(append(files, host...)), nil
}

// AgnhostImage builds agnhost's image: /agnhost as entrypoint (command
// pause, as upstream), the agnhost-2 link, porter's certificate, /uploads,
// the image's user 1000 and group 50000, and HostTools with their
// libraries. Written as a `docker save` tarball with spec.Tags, for
// `ctr images import`.
func AgnhostImage(spec ImageSpec, out string) error {
	files, err := agnhostFiles(spec)
	if err != nil {
		return err
	}
	return writeImage(out, files, spec.Tags, spec.Created,
		"weft e2e/conformance: agnhost built from the pinned source, tools from the build host",
		v1.Config{
			Entrypoint: []string{"/agnhost"},
			Cmd:        []string{"pause"},
			Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			WorkingDir: "/",
			ExposedPorts: map[string]struct{}{
				"80/tcp": {}, "8080/tcp": {}, "8081/tcp": {}, "9376/tcp": {}, "5000/tcp": {},
			},
		})
}

// ProgramImage builds the image of one static program: /<name> as its
// entrypoint and nothing else, as upstream's test images of Go programs and
// CoreDNS's (distroless) image are; a `docker save` tarball with tags, for
// `ctr images import`.
func ProgramImage(bin, name string, tags []string, created time.Time, out string) error {
	data, err := os.ReadFile(bin)
	if err != nil {
		return fmt.Errorf("conformance: %w", err)
	}
	files := []entry{
		{Path: name, Mode: 0o755, Data: data},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
	}
	return writeImage(out, files, tags, created, "weft e2e/conformance: "+name+" built from the pinned source",
		v1.Config{Entrypoint: []string{"/" + name}, WorkingDir: "/"})
}

// BusyBox is the static busybox of Debian's busybox-static package, the
// program of upstream's e2e-test-images/busybox.
const BusyBox = "/bin/busybox"

// BusyBoxImage builds e2e-test-images/busybox as upstream's is made: a
// static busybox with a link in /bin for each of its applets (busybox
// --list), /bin/sh among them; no entrypoint, command sh. Written as a
// `docker save` tarball with tags.
func BusyBoxImage(busybox string, tags []string, created time.Time, out string) error {
	files, err := busyboxFiles(busybox)
	if err != nil {
		return err
	}
	return writeImage(out, files, tags, created, "weft e2e/conformance: busybox from the build host's busybox-static",
		v1.Config{
			Cmd:        []string{"sh"},
			Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			WorkingDir: "/",
		})
}

func busyboxFiles(busybox string) ([]entry, error) {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return nil, fmt.Errorf("conformance: %w (make deps-conformance installs busybox-static)", err)
	}
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("conformance: %s --list: %w", busybox, err)
	}
	files := []entry{
		{Path: "bin/busybox", Mode: 0o755, Data: bin},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
		{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n")},
		{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" || strings.Contains(applet, "/") {
			continue
		}
		files = append(files, entry{Path: "bin/" + applet, Mode: os.ModeSymlink | 0o777, Link: "busybox"})
	}
	return files, nil
}

// TagsOf picks from e2e.test's --list-images output the names of the
// e2e-test-images image repo (e.g. regression-issue-74839).
func TagsOf(list, repo string) []string {
	var tags []string
	for _, l := range strings.Fields(list) {
		r, _, ok := strings.Cut(l[strings.LastIndex(l, "/")+1:], ":")
		if ok && r == repo && strings.Contains(l, "e2e-test-images/") {
			tags = append(tags, l)
		}
	}
	return tags
}

// writeImage writes an image of one layer of files, with config, as a
// `docker save` tarball named by tags.
func writeImage(out string, files []entry, tags []string, created time.Time, createdBy string, config v1.Config) error {
	layerData, err := ociimage.LayerTar(files, created)
	if err != nil {
		return fmt.Errorf("conformance: %w", err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerData)), nil
	})
	if err != nil {
		return fmt.Errorf("conformance: image layer: %w", err)
	}
	img, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layer, History: v1.History{
		Created: v1.Time{Time: created}, CreatedBy: createdBy,
	}})
	if err != nil {
		return fmt.Errorf("conformance: image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Created = v1.Time{Time: created}
	cf.Config = config
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	if err := ociimage.WriteTarball(out, img, tags); err != nil {
		return fmt.Errorf("conformance: %w", err)
	}
	return nil
}

func agnhostFiles(spec ImageSpec) ([]entry, error) {
	bin, err := os.ReadFile(spec.Agnhost)
	if err != nil {
		return nil, fmt.Errorf("conformance: %w", err)
	}
	files := []entry{
		{Path: "agnhost", Mode: 0o755, Data: bin},
		{Path: "agnhost-2", Mode: os.ModeSymlink | 0o777, Link: "agnhost"},
		{Path: "uploads", Mode: os.ModeDir | 0o755},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
		{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\nuser-defined-in-image:x:1000:1000::/home/user-defined-in-image:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")},
		{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\nuser-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\nnogroup:x:65534:\n")},
		{Path: "etc/nsswitch.conf", Mode: 0o644, Data: []byte("hosts: files dns\npasswd: files\ngroup: files\n")},
	}
	for _, f := range []string{"localhost.crt", "localhost.key"} {
		data, err := os.ReadFile(filepath.Join(spec.KubeSrc, "test", "images", "agnhost", "porter", f))
		if err != nil {
			return nil, fmt.Errorf("conformance: porter's certificate: %w", err)
		}
		files = append(files, entry{Path: f, Mode: 0o644, Data: data})
	}
	if spec.CoreDNS != "" {
		bin, err := os.ReadFile(spec.CoreDNS)
		if err != nil {
			return nil, fmt.Errorf("conformance: %w", err)
		}
		files = append(files, entry{Path: "coredns", Mode: 0o755, Data: bin})
	}
	host, err := hostFiles(HostTools)
	if err != nil {
		return nil, err
	}
	return append(files, host...), nil
}

// hostFiles are the programs (looked up on PATH) and every shared library
// ldd lists for them, at their real paths, plus this host's links of the
// merged /usr (bin -> usr/bin, lib64 -> usr/lib64, ...), so that the
// programs' interpreter and library paths resolve as on the host.
func hostFiles(progs []string) ([]entry, error) {
	want := map[string]bool{}
	var missing []string
	for _, p := range progs {
		full, err := lookPath(p)
		if err != nil {
			missing = append(missing, p)
			continue
		}
		want[full] = true
		libs, err := lddLibs(full)
		if err != nil {
			return nil, err
		}
		for _, l := range libs {
			want[l] = true
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("conformance: %s missing on this machine: make conformance installs them (deps-conformance: curl, wget, netcat-openbsd, iproute2, bash, coreutils, bind9-dnsutils, libc-bin)", strings.Join(missing, ", "))
	}
	var files []entry
	links := map[string]string{}
	// The merged /usr's top-level links, met or not: a command line may
	// name /bin/sh while PATH found /usr/bin/sh.
	for _, top := range []string{"/bin", "/sbin", "/lib", "/lib64"} {
		if to, err := os.Readlink(top); err == nil {
			links[top] = to
		}
	}
	for p := range want {
		// Every link on the way (the merged /usr's /lib64, or the
		// alternatives' /usr/bin/nc -> /etc/alternatives/nc) goes in as a
		// link, its final target as the file.
		real, chain, err := resolve(p)
		if err != nil {
			return nil, err
		}
		for from, to := range chain {
			links[from] = to
		}
		st, err := os.Stat(real)
		if err != nil {
			return nil, fmt.Errorf("conformance: %w", err)
		}
		data, err := os.ReadFile(real)
		if err != nil {
			return nil, fmt.Errorf("conformance: %w", err)
		}
		files = append(files, entry{Path: strings.TrimPrefix(real, "/"), Mode: st.Mode().Perm(), Data: data})
	}
	for from, to := range links {
		files = append(files, entry{Path: strings.TrimPrefix(from, "/"), Mode: os.ModeSymlink | 0o777, Link: to})
	}
	return dedupe(files), nil
}

// lookPath finds a program on the standard PATH of a Debian root.
func lookPath(p string) (string, error) {
	for _, d := range []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"} {
		full := filepath.Join(d, p)
		if st, err := os.Stat(full); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return full, nil
		}
	}
	return "", fmt.Errorf("conformance: %s not found", p)
}

// resolve follows p's links component by component and returns the real
// path and every link met, as path -> target (the target as written).
func resolve(p string) (string, map[string]string, error) {
	chain := map[string]string{}
	cur := "/"
	rest := strings.Split(strings.TrimPrefix(filepath.Clean(p), "/"), "/")
	for hops := 0; len(rest) > 0; {
		next := filepath.Join(cur, rest[0])
		rest = rest[1:]
		st, err := os.Lstat(next)
		if err != nil {
			return "", nil, fmt.Errorf("conformance: %w", err)
		}
		if st.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		if hops++; hops > 40 {
			return "", nil, fmt.Errorf("conformance: too many links resolving %s", p)
		}
		to, err := os.Readlink(next)
		if err != nil {
			return "", nil, fmt.Errorf("conformance: %w", err)
		}
		chain[next] = to
		target := to
		if !filepath.IsAbs(to) {
			target = filepath.Join(cur, to)
		}
		rest = append(strings.Split(strings.TrimPrefix(filepath.Clean(target), "/"), "/"), rest...)
		cur = "/"
	}
	return cur, chain, nil
}

// lddLibs lists the absolute paths in ldd's output for bin (none for a
// static binary).
func lddLibs(bin string) ([]string, error) {
	out, err := execOutput("ldd", bin)
	if err != nil {
		if strings.Contains(string(out), "not a dynamic executable") {
			return nil, nil
		}
		return nil, fmt.Errorf("conformance: ldd %s: %w: %s", bin, err, bytes.TrimSpace(out))
	}
	var libs []string
	s := bufio.NewScanner(bytes.NewReader(out))
	for s.Scan() {
		for _, f := range strings.Fields(s.Text()) {
			if strings.HasPrefix(f, "/") {
				libs = append(libs, f)
			}
		}
	}
	return libs, nil
}

func execOutput(name string, args ...string) ([]byte, error) {
	return exec.Command(name, args...).CombinedOutput()
}

func dedupe(files []entry) []entry {
	seen := map[string]bool{}
	var out []entry
	for _, f := range files {
		if !seen[f.Path] {
			seen[f.Path] = true
			out = append(out, f)
		}
	}
	return out
}
