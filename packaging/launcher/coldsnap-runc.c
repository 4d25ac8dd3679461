/* coldsnap-runc: coldsnap-runtime's front door, for a node where every container goes through it.
 *
 * It decides, before any Python starts, whether a runc call can be ColdSnap's business:
 *
 *   create / run   of a bundle whose config.json mentions io.coldsnap.capsule or COLDSNAP_CAPSULE=
 *   start / delete of a container id with a marker in /run/coldsnap-shim/ (the shim made a record of it)
 *
 * Those go to coldsnap-runtime (the Python shim beside this file), which decides exactly (a false alarm here only
 * costs that call the shim's start-up). Everything else execs the real runc with the caller's argv unchanged.
 * The real runc is $COLDSNAP_RUNC, else "runc" of /etc/coldsnap/runtime.json, else runc on PATH (never this file
 * or the shim). The argv parse follows runc's (urfave/cli): global flags, the subcommand, its flags, positionals;
 * flags as -x, --x, --x=v or --x v; `--` ends the flags.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MARKERS "/run/coldsnap-shim/"
#define RUNTIME_JSON "/etc/coldsnap/runtime.json"
#define MAX_SPEC (16 << 20)

static const char *global_value[] = {"root", "log", "log-format", "criu", "rootless", NULL};
static const char *create_value[] = {"bundle", "b", "console-socket", "pid-file", "preserve-fds", NULL};

static int in(const char *name, const char **list) {
    for (; *list; list++)
        if (strcmp(name, *list) == 0) return 1;
    return 0;
}

/* "--pid-file=x" -> "pid-file" (into buf); not a flag -> 0 */
static int flag_name(const char *tok, char *buf, size_t n, int *has_value) {
    if (tok[0] != '-' || tok[1] == '\0' || strcmp(tok, "--") == 0) return 0;
    const char *name = tok[1] == '-' ? tok + 2 : tok + 1;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    if (len == 0 || len >= n) return 0;
    memcpy(buf, name, len);
    buf[len] = '\0';
    *has_value = eq != NULL;
    return 1;
}

/* Skip the flags from argv[i]; a flag in `values` takes the next token unless written --x=v.
 * *bundle gets the --bundle/-b (or, for globals, --root) value when asked for. Returns the index of the first
 * positional. */
static int skip_flags(int argc, char **argv, int i, const char **values, const char **bundle) {
    char name[64];
    int has_value;
    while (i < argc) {
        if (strcmp(argv[i], "--") == 0) return i + 1;
        if (!flag_name(argv[i], name, sizeof name, &has_value)) return i;
        const char *value = has_value ? strchr(argv[i], '=') + 1 : NULL;
        if (!has_value && in(name, values) && i + 1 < argc) value = argv[++i];
        if (bundle && value && (strcmp(name, "bundle") == 0 || strcmp(name, "b") == 0 || strcmp(name, "root") == 0))
            *bundle = value;
        i++;
    }
    return i;
}

static int mentions_capsule(const char *bundle) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/config.json", bundle && *bundle ? bundle : ".");
    FILE *f = fopen(path, "rb");
    if (!f) return 0; /* runc reports a missing bundle */
    char *buf = malloc(MAX_SPEC + 1);
    size_t n = buf ? fread(buf, 1, MAX_SPEC, f) : 0;
    fclose(f);
    if (!buf) return 1; /* cannot tell: let the shim look */
    buf[n] = '\0';
    int hit = memmem(buf, n, "io.coldsnap.capsule", 19) || memmem(buf, n, "COLDSNAP_CAPSULE=", 17) || n == MAX_SPEC;
    free(buf);
    return hit;
}

/* the marker the shim keeps for a container: MARKERS<FNV-1a 64 of realpath(root)>-<id> (coldsnap.oci.records) */
static int has_marker(const char *root, const char *id) {
    char real[PATH_MAX], path[PATH_MAX];
    if (!id || !*id || strchr(id, '/') || id[0] == '.') return 0;
    if (!realpath(root, real)) return 0; /* no runc root: runc knows no such container either */
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (const unsigned char *p = (const unsigned char *)real; *p; p++) h = (h ^ *p) * 0x100000001b3ULL;
    snprintf(path, sizeof path, MARKERS "%016llx-%s", h, id);
    return access(path, F_OK) == 0;
}

/* this launcher or the shim, under whatever name a runtime was installed as runc */
static int is_us(const char *path) {
    char real[PATH_MAX];
    if (!realpath(path, real)) return 0;
    const char *base = strrchr(real, '/') ? strrchr(real, '/') + 1 : real;
    return strcmp(base, "coldsnap-runc") == 0 || strcmp(base, "coldsnap-runtime") == 0;
}

/* "runc": "PATH" of runtime.json, found textually (the Python shim reads the same file as JSON). */
static int runc_from_config(char *out, size_t n) {
    FILE *f = fopen(RUNTIME_JSON, "rb");
    if (!f) return 0;
    char buf[65536];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    char *key = strstr(buf, "\"runc\"");
    if (!key) return 0;
    char *colon = strchr(key + 6, ':');
    char *open = colon ? strchr(colon, '"') : NULL;
    char *close = open ? strchr(open + 1, '"') : NULL;
    if (!close || (size_t)(close - open - 1) >= n) return 0;
    memcpy(out, open + 1, close - open - 1);
    out[close - open - 1] = '\0';
    return 1;
}

static int find_runc(char *out, size_t n) {
    const char *env = getenv("COLDSNAP_RUNC");
    if (env && *env) {
        snprintf(out, n, "%s", env);
        return access(out, X_OK) == 0 && !is_us(out);
    }
    if (runc_from_config(out, n)) return access(out, X_OK) == 0 && !is_us(out);
    const char *path = getenv("PATH");
    char dirs[8192];
    snprintf(dirs, sizeof dirs, "%s", path && *path ? path : "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    for (char *save = NULL, *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(out, n, "%s/runc", *d ? d : ".");
        struct stat st;
        if (stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0 && !is_us(out)) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    char self[PATH_MAX], self_dir[PATH_MAX], runc[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return 127;
    self[len] = '\0';
    snprintf(self_dir, sizeof self_dir, "%s", self);
    *strrchr(self_dir, '/') = '\0';

    const char *root = "/run/runc";
    int i = skip_flags(argc, argv, 1, global_value, &root);
    const char *command = i < argc ? argv[i] : NULL;
    const char *bundle = NULL;
    int ours = 0;
    if (command && (strcmp(command, "create") == 0 || strcmp(command, "run") == 0)) {
        int first = skip_flags(argc, argv, i + 1, create_value, &bundle);
        ours = first < argc && mentions_capsule(bundle);
    } else if (command && (strcmp(command, "start") == 0 || strcmp(command, "delete") == 0)) {
        int first = skip_flags(argc, argv, i + 1, (const char *[]){NULL}, NULL);
        ours = first < argc && has_marker(root, argv[first]);
    }
    if (ours) {
        char shim[PATH_MAX];
        if (snprintf(shim, sizeof shim, "%s/coldsnap-runtime", self_dir) >= (int)sizeof shim) return 127;
        argv[0] = shim;
        execv(shim, argv);
        fprintf(stderr, "coldsnap-runc: cannot run %s: %s\n", shim, strerror(errno));
        return 127;
    }
    if (!find_runc(runc, sizeof runc)) {
        fprintf(stderr, "coldsnap-runc: no runc found: set COLDSNAP_RUNC, write {\"runc\": PATH} to "
                        RUNTIME_JSON ", or put runc on PATH\n");
        return 1;
    }
    argv[0] = runc;
    execv(runc, argv);
    fprintf(stderr, "coldsnap-runc: cannot run %s: %s\n", runc, strerror(errno));
    return 127;
}
